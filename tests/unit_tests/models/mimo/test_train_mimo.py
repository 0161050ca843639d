"""examples/mimo/train_mimo.py: colocated and disjoint placements train the same model the
same way, the gradient-reduction flags reach every module's DDP (overlap changes nothing
computed), and bad or unimplemented flags fail before any process group exists."""

import importlib.util
import pathlib
import sys

import pytest
import torch

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
        (["--optimizer", "muon"], "--optimizer muon: the MIMO example steps its modules with adam or sgd"),
    ],
)
def test_bad_flags_fail_with_the_flag_named(extra, message):
    with pytest.raises(ArgumentError, match=message):
        load_script().parse_mimo_args(ARGV + extra, world_size=4)


OVERLAP_FLAGS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _train_with_and_without_overlap(tmp_dir):
    """The same colocated DP2 run (2 micro-batches per step, a few buckets per module) with and
    without the overlap flags; per run its loss curve, final parameters and DDP settings."""
    script = load_script()
    results = []
    for name, extra in (("plain", ["--use-distributed-optimizer"]), ("overlap", OVERLAP_FLAGS)):
        jsonl = f"{tmp_dir}/{name}.jsonl"
        flags = ARGV + extra + ["--ddp-bucket-size", "2000", "--log-interval", "1", "--metrics-jsonl", jsonl]
        args = script.parse_mimo_args(flags, world_size=2)
        script.initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
        trainer = script.MimoTrainer(args)
        trainer.train()
        trainer.logger.close()
        settings = {
            module: (
                ddp.ddp_config.overlap_grad_reduce,
                ddp.ddp_config.overlap_param_gather,
                len(ddp.param_and_grad_buffers[0].buckets),
            )
            for module, ddp in trainer.ddp.items()
        }
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        losses = loss_curve(jsonl) if trainer.logger.enabled else None
        results.append((losses, params, settings))
    return results


def test_overlap_flags_reach_every_module_and_change_nothing_computed(tmp_path):
    curves = []
    for (plain_losses, plain_params, plain_settings), (losses, params, settings) in run_distributed(
        _train_with_and_without_overlap, 2, str(tmp_path)
    ):
        assert {m: s[:2] for m, s in plain_settings.items()} == {
            "language_model": (False, False),
            "images": (False, False),
        }
        assert {m: s[:2] for m, s in settings.items()} == {"language_model": (True, True), "images": (True, True)}
        assert all(s[2] > 1 for s in settings.values())  # several buckets: reductions start during backward
        for name, value in plain_params.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)
        if losses is not None:
            curves.append((plain_losses, losses))
    ((plain_losses, losses),) = curves  # one logging rank
    assert len(losses) == 6 and losses == plain_losses


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--mock-data"], "--mock-data"),
        (["--data-path", "a_text_document"], "--data-path"),
        (["--eval-interval", "2"], "--eval-interval"),
        (["--exit-interval", "3"], "--exit-interval"),
        (["--manual-gc"], "--manual-gc"),
        (["--profile"], "--profile"),
        (["--use-torch-compile"], "--use-torch-compile"),
        (["--log-params-norm"], "--log-params-norm"),
        (["--step-batch-size-schedule", "0:8"], "--step-batch-size-schedule"),
        (["--decoupled-lr", "1e-3"], "--decoupled-lr"),
        (["--test-mode"], "--test-mode"),
        (["--eval-global-batch-size", "8"], "--eval-global-batch-size"),
    ],
)
def test_flags_the_example_does_not_implement_are_refused(extra, flag):
    with pytest.raises(ArgumentError, match=f"^{flag}: the MIMO example"):
        load_script().parse_mimo_args(ARGV + extra, world_size=4)
