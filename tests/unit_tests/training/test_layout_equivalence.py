"""The same training run under TP2, PP2, GTP2, DP2 (with and without the distributed
optimizer) gives the single-process loss curve, and the loss goes down."""

import pytest

from megatron.training.arguments import parse_args
from megatron.training.training import pretrain
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve
from tests.unit_tests.training.tiny_training import CURVE_RUN, TINY_RUN

# The tiny run of 10 steps, without evaluation (also used by test_expert_parallel_training).
COMMON = [*TINY_RUN, *CURVE_RUN, "--num-layers", "2", "--train-iters", "10", "--eval-iters", "0", "--log-interval", "1"]


def _train(family, flags, world_size, metrics_jsonl):
    args = parse_args(COMMON + flags + ["--metrics-jsonl", metrics_jsonl], model_family=family, world_size=world_size)
    pretrain(args)


def _curve(family, flags, world_size, tmp_dir):
    """The per-iteration losses the run's logging rank recorded (--log-interval 1)."""
    metrics = str(tmp_dir / "metrics.jsonl")
    run_distributed(_train, world_size, family, flags, world_size, metrics)
    return loss_curve(metrics)


GPT_LAYOUTS = {
    "TP2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP2": ["--pipeline-model-parallel-size", "2"],
    "GTP2": ["--generalized-tensor-parallel-size", "2"],
    "DP2": [],
    "DP2-distopt": ["--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    return _curve("gpt", [], 1, tmp_path_factory.mktemp("gpt_reference"))


def test_gpt_loss_decreases(gpt_reference):
    assert gpt_reference[-1] < gpt_reference[0] - 0.1


@pytest.mark.parametrize("layout", list(GPT_LAYOUTS))
def test_gpt_layouts_reproduce_single_process_losses(gpt_reference, layout, tmp_path):
    curve = _curve("gpt", GPT_LAYOUTS[layout], 2, tmp_path)
    assert curve == pytest.approx(gpt_reference, rel=1e-4)


def test_hybrid_tp2_pp2_reproduces_single_process_losses(tmp_path):
    flags = [
        "--hybrid-layer-pattern",
        "M*|M-",
        "--num-layers",
        "4",
        "--mamba-head-dim",
        "8",
        "--mamba-state-dim",
        "8",
        "--mamba-num-groups",
        "2",
    ]
    reference = _curve("hybrid", flags, 1, tmp_path / "reference")
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    curve = _curve("hybrid", flags + layout, 4, tmp_path / "tp2_pp2")
    assert curve == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]
