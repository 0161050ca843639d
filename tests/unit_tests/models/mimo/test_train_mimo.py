"""examples/mimo/train_mimo.py: colocated and disjoint placements train the same model the
same way, and bad flags fail before any process group exists."""

import importlib.util
import pathlib
import sys

import pytest

from megatron.training.arguments import ArgumentError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve

SCRIPT = pathlib.Path(__file__).parents[4] / "examples" / "mimo" / "train_mimo.py"
ARGV = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 6 --lr 3e-3 --image-size 8 --patch-size 4 --encoder-num-layers 1 "
    "--encoder-hidden-size 16 --log-interval 3 --hidden-dropout 0.0 --attention-dropout 0.0"
).split()


def load_script():
    spec = importlib.util.spec_from_file_location("train_mimo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_mimo"] = module
    spec.loader.exec_module(module)
    return module


def _train(extra, metrics_jsonl):
    script = load_script()
    script.train(script.parse_mimo_args(ARGV + extra + ["--log-interval", "1", "--metrics-jsonl", metrics_jsonl]))


def test_disjoint_encoder_trains_like_colocated(tmp_path):
    run_distributed(_train, 2, ["--tensor-model-parallel-size", "2"], str(tmp_path / "colocated.jsonl"))
    disjoint_flags = ["--tensor-model-parallel-size", "2", "--encoder-ranks", "first-2"]
    run_distributed(_train, 6, disjoint_flags, str(tmp_path / "disjoint.jsonl"))
    curve = loss_curve(tmp_path / "colocated.jsonl")
    assert len(curve) == 6 and curve[-1] < curve[0] - 0.5  # it learns
    assert loss_curve(tmp_path / "disjoint.jsonl") == pytest.approx(curve, rel=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--encoder-ranks", "first-4"], "--encoder-ranks must be 'colocated' or 'first-N' with 0 < N < world size 4"),
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size must be 1 for MIMO models"),
        (["--image-size", "10"], r"--image-size \(10\) must be a multiple of --patch-size \(4\)"),
        (["--encoder-tensor-model-parallel-size", "4"], r"--encoder-num-attention-heads \(2\) must be divisible"),
    ],
)
def test_bad_flags_fail_with_the_flag_named(extra, message):
    with pytest.raises(ArgumentError, match=message):
        load_script().parse_mimo_args(ARGV + extra, world_size=4)
