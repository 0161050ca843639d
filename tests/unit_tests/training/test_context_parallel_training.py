"""Context parallelism through the real training loop: CP2, CP4 and CP combined with TP+SP,
PP, GTP, DP with the distributed optimizer, selective recomputation and multi-token
prediction give the single-process loss curve (GPT with RoPE and GQA; a hybrid ``M*M-``
model), and a checkpoint saved at CP2xTP2 resumes at CP1 and at TP2xDP2 on the straight
run's curve."""

import pytest

from megatron.core.dist_checkpointing import write_latest_iteration
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration
from tests.unit_tests.training.tiny_training import CURVE_RUN, TINY_RUN

# The tiny run with GQA and sequences of 32 (two chunks of 8 per rank at CP2), ending with one
# evaluation batch of each split, so evaluation runs under every layout.
COMMON = [*TINY_RUN, *CURVE_RUN, "--num-query-groups", "2", "--seq-length", "32", "--eval-iters", "1"]
COMMON += ["--log-interval", "1"]
GPT = ["--num-layers", "2", "--position-embedding-type", "rope", "--train-iters", "10"]
HYBRID = [
    "--hybrid-layer-pattern",
    "M*M-",
    "--num-layers",
    "4",
    "--mamba-head-dim",
    "8",
    "--mamba-state-dim",
    "8",
    "--mamba-num-groups",
    "4",
    "--train-iters",
    "10",
]
CP2 = ["--context-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]


def _train(family, flags, world_size, metrics_jsonl):
    args = parse_args(
        COMMON + flags + ["--metrics-jsonl", str(metrics_jsonl)], model_family=family, world_size=world_size
    )
    pretrain(args)


def _curve(family, flags, world_size, tmp_dir):
    metrics = tmp_dir / "metrics.jsonl"
    run_distributed(_train, world_size, family, flags, world_size, metrics)
    return loss_curve(metrics)


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    return _curve("gpt", GPT, 1, tmp_path_factory.mktemp("gpt_cp1"))


@pytest.fixture(scope="module")
def hybrid_reference(tmp_path_factory):
    return _curve("hybrid", HYBRID, 1, tmp_path_factory.mktemp("hybrid_cp1"))


GPT_LAYOUTS = {
    "CP2": (CP2, 2),
    "CP2-all_gather": (CP2 + ["--cp-comm-type", "all_gather"], 2),
    "CP4": (["--context-parallel-size", "4"], 4),
    "CP2xTP2-SP": (CP2 + TP2 + ["--sequence-parallel"], 4),
    "CP2xPP2": (CP2 + ["--pipeline-model-parallel-size", "2"], 4),
    "CP2xDP2-distopt": (CP2 + ["--use-distributed-optimizer"], 4),
    "CP2-recompute-selective": (CP2 + ["--recompute-granularity", "selective"], 2),
}


@pytest.mark.parametrize("layout", list(GPT_LAYOUTS))
def test_gpt_context_parallel_layouts_reproduce_single_process_losses(gpt_reference, layout, tmp_path):
    flags, world_size = GPT_LAYOUTS[layout]
    curve = _curve("gpt", GPT + flags, world_size, tmp_path)
    assert curve == pytest.approx(gpt_reference, rel=1e-5)
    assert gpt_reference[-1] < gpt_reference[0] - 0.1


def test_gpt_multi_token_prediction_under_cp2_reproduces_single_process_losses(tmp_path):
    """MTP's shifted inputs and targets cross chunk boundaries: they are taken on the whole sequence."""
    flags = GPT + ["--mtp-num-layers", "2"]
    reference = _curve("gpt", flags, 1, tmp_path / "cp1")
    assert _curve("gpt", flags + CP2, 2, tmp_path / "cp2") == pytest.approx(reference, rel=1e-5)


def test_gpt_per_token_loss_under_cp2_reproduces_single_process_losses(tmp_path):
    """With --calculate-per-token-loss sums and token counts add up over dp_cp, CP ranks included."""
    flags = GPT + ["--calculate-per-token-loss"]
    reference = _curve("gpt", flags, 1, tmp_path / "cp1")
    assert _curve("gpt", flags + CP2 + ["--use-distributed-optimizer"], 4, tmp_path / "cp2") == pytest.approx(
        reference, rel=1e-5
    )


HYBRID_LAYOUTS = {
    "CP2": (CP2, 2),
    "CP4": (["--context-parallel-size", "4"], 4),
    "CP2xTP2-SP": (CP2 + TP2 + ["--sequence-parallel"], 4),
    "CP2xGTP2": (CP2 + ["--generalized-tensor-parallel-size", "2"], 4),
}


@pytest.mark.parametrize("layout", list(HYBRID_LAYOUTS))
def test_hybrid_context_parallel_layouts_reproduce_single_process_losses(hybrid_reference, layout, tmp_path):
    flags, world_size = HYBRID_LAYOUTS[layout]
    curve = _curve("hybrid", HYBRID + flags, world_size, tmp_path)
    assert curve == pytest.approx(hybrid_reference, rel=1e-5)
    assert hybrid_reference[-1] < hybrid_reference[0]


def test_checkpoint_saved_at_cp2_tp2_resumes_at_cp1_and_tp2_dp2(tmp_path):
    """10 straight steps at CP2xTP2 saving at 5; resuming from 5 at CP1 and at TP2xDP2 gives
    the straight run's losses of steps 6..10 (the optimizer state reshards with the weights)."""
    save = tmp_path / "ckpt"
    flags = GPT + ["--save", str(save), "--save-interval", "5", "--use-distributed-optimizer"]
    straight = _curve("gpt", flags + CP2 + TP2, 4, tmp_path / "straight")
    write_latest_iteration(str(save), 5)
    for name, layout, world_size in (("cp1", [], 1), ("tp2_dp2", TP2, 4)):
        resumed_flags = GPT + ["--load", str(save), "--use-distributed-optimizer"] + layout
        metrics = tmp_path / f"{name}.jsonl"
        run_distributed(_train, world_size, "gpt", resumed_flags, world_size, metrics)
        resumed = losses_by_iteration(metrics)
        assert sorted(resumed) == list(range(6, 11)), name
        assert [resumed[i] for i in range(6, 11)] == pytest.approx(straight[5:], rel=1e-5), name


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_attention_dropout_under_cp2_drops_and_repeats_with_the_seed(gpt_reference, comm_type, tmp_path):
    """Megatron's default attention dropout (0.1) under CP2: the run learns, is its own repeat with
    the same seed, and differs from the dropout-free curve from the first step on."""
    flags = GPT + CP2 + ["--cp-comm-type", comm_type, "--attention-dropout", "0.1"]
    first, again = (_curve("gpt", flags, 2, tmp_path / name) for name in ("a", "b"))
    assert first == again and first[-1] < first[0]
    assert first[0] != pytest.approx(gpt_reference[0], rel=1e-6)
