"""Training with virtual pipeline stages on two ranks (PP2 x V2) through the real loop: the
single-process loss curve for GPT and hybrid models, and resuming across VPP <-> plain PP."""

import json

import pytest

from megatron.training.arguments import ArgumentError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny

# One evaluation batch of each split ends a run, so evaluation runs through the virtual pipeline.
RUN = [*CURVE_RUN, "--lr-decay-iters", "8", "--eval-iters", "1", "--log-interval", "1"]
GPT = ["--num-layers", "4"]
HYBRID = [
    "--num-layers",
    "8",
    "--hybrid-layer-pattern",
    "M*|M-|*M|-M",
    "--mamba-head-dim",
    "8",
    "--mamba-state-dim",
    "8",
    "--mamba-num-groups",
    "2",
]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _train(family, flags, world_size, metrics_jsonl):
    train_tiny(RUN + flags, family, world_size, metrics_jsonl)


def _curve(family, flags, world_size, metrics_jsonl):
    run_distributed(_train, world_size, family, flags, world_size, metrics_jsonl)
    return loss_curve(metrics_jsonl)


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    return _curve("gpt", GPT + ["--train-iters", "6"], 1, tmp_path_factory.mktemp("gpt") / "pp1.jsonl")


def test_gpt_pp2_vp2_reproduces_the_single_process_curve(gpt_reference, tmp_path):
    flags = GPT + ["--train-iters", "6"] + PP2 + ["--virtual-pipeline-model-parallel-size", "2"]
    assert _curve("gpt", flags, 2, tmp_path / "vpp.jsonl") == pytest.approx(gpt_reference, rel=1e-5)
    assert gpt_reference[-1] < gpt_reference[0]


def _evaluations(jsonl_path) -> dict[str, float]:
    with open(jsonl_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return {r["type"]: r["lm loss"] for r in records if r["type"] != "train"}


def test_micro_batch_groups_and_evaluation_batches_of_their_own_size(tmp_path):
    """Three micro-batches per step through PP2 x V2 in one group of three (Megatron's
    --microbatch-group-size-per-virtual-pipeline-stage; the default group of two cannot split
    three), and evaluation in 4 steps of 3 single-sample micro-batches: the single-process run's
    losses, and its evaluation over the same 12 samples (2 steps of 3 two-sample micro-batches)."""
    flags = GPT + ["--train-iters", "4", "--global-batch-size", "6", "--eval-iters", "2"]
    reference_path, path = tmp_path / "pp1.jsonl", tmp_path / "vpp.jsonl"
    reference = _curve("gpt", flags, 1, reference_path)
    grouped = [*PP2, "--virtual-pipeline-model-parallel-size", "2"]
    grouped += ["--microbatch-group-size-per-virtual-pipeline-stage"]
    evaluation = ["--eval-iters", "4", "--eval-global-batch-size", "3", "--eval-micro-batch-size", "1"]
    assert _curve("gpt", flags + grouped + ["3"] + evaluation, 2, path) == pytest.approx(reference, rel=1e-5)
    want = _evaluations(reference_path)
    assert want.keys() == {"validation", "test"}
    assert _evaluations(path) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ArgumentError, match="micro-batches per step: 3; the interleaved schedule runs groups of G"):
        tiny_args(flags + grouped + ["4"], world_size=2)
    with pytest.raises(ArgumentError, match=r"^evaluation micro-batches per step: 5; .* \(5 % 4 = 1\) must be empty"):
        eight = flags[:-4] + ["--global-batch-size", "8"]
        tiny_args(eight + grouped + ["4", "--eval-global-batch-size", "10"], world_size=2)


@pytest.mark.parametrize(
    "flags,virtual_size",
    [
        (["--virtual-pipeline-model-parallel-size", "2"], 2),
        (["--num-layers-per-virtual-pipeline-stage", "1"], 2),  # 4 layers / PP2 / 1 per virtual stage
        (["--num-layers-per-virtual-pipeline-stage", "2"], None),  # V = 1: plain 1F1B
        ([], None),
    ],
)
def test_either_flag_sets_the_virtual_pipeline_size(flags, virtual_size):
    args = tiny_args(RUN + GPT + ["--train-iters", "1"] + PP2 + flags, world_size=2)
    assert args.virtual_pipeline_model_parallel_size == virtual_size


def test_hybrid_pp2_vp2_over_four_segments_reproduces_the_single_process_curve(tmp_path):
    flags = HYBRID + ["--train-iters", "4"]
    reference = _curve("hybrid", flags, 1, tmp_path / "pp1.jsonl")
    curve = _curve("hybrid", flags + PP2 + ["--virtual-pipeline-model-parallel-size", "2"], 2, tmp_path / "vpp.jsonl")
    assert curve == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("first,then", [("pp", "vpp"), ("vpp", "pp")])
def test_resume_across_virtual_and_plain_pipeline_is_exact(first, then, tmp_path):
    layouts = {"pp": PP2, "vpp": PP2 + ["--virtual-pipeline-model-parallel-size", "2"]}
    save = str(tmp_path / "ckpt")
    straight = ["--train-iters", "6", "--save", save, "--save-interval", "3"]
    _curve("gpt", GPT + straight + layouts[first], 2, tmp_path / "straight.jsonl")
    from megatron.core.dist_checkpointing import write_latest_iteration

    write_latest_iteration(save, 3)
    resumed = ["--train-iters", "6", "--load", save]
    run_distributed(_train, 2, "gpt", GPT + resumed + layouts[then], 2, tmp_path / "resumed.jsonl")
    straight_losses = losses_by_iteration(tmp_path / "straight.jsonl")
    resumed_losses = losses_by_iteration(tmp_path / "resumed.jsonl")
    assert sorted(resumed_losses) == [4, 5, 6]
    assert [resumed_losses[i] for i in (4, 5, 6)] == [straight_losses[i] for i in (4, 5, 6)]


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            PP2 + ["--virtual-pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
            "are mutually exclusive",
        ),
        (PP2 + ["--virtual-pipeline-model-parallel-size", "3"], r"--num-layers \(4\) must be divisible by"),
        (PP2 + ["--num-layers-per-virtual-pipeline-stage", "3"], r"--num-layers \(4\) must be divisible by"),
        (
            PP2 + ["--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "6"],
            r"^micro-batches per step: 3; .* \(3 % 2 = 1\) must be empty .* \(set by --microbatch-group-size-per-",
        ),
        (["--virtual-pipeline-model-parallel-size", "2"], "need --pipeline-model-parallel-size > 1"),
    ],
)
def test_bad_virtual_pipeline_flags_are_argument_errors(flags, message):
    with pytest.raises(ArgumentError, match=message):
        tiny_args(RUN + GPT + ["--train-iters", "1"] + flags, world_size=2)


def test_hybrid_segments_must_divide_among_the_virtual_stages():
    flags = HYBRID + ["--train-iters", "1"] + PP2 + ["--virtual-pipeline-model-parallel-size", "4"]
    with pytest.raises(ArgumentError, match=r"4 pipeline segment\(s\) .* among 2 pipeline stage\(s\) x 4 virtual"):
        tiny_args(RUN + flags, "hybrid", world_size=2)


def _inference_params(path, pp):
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.model_state import checkpoint_params
    from megatron.core.inference.checkpoint_loading import load_inference_model

    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    model, _, _ = load_inference_model(path, pgc)
    return {spec.key: spec.param.detach().clone() for spec in checkpoint_params(model)}


def _inference_logits(path):
    import torch

    from megatron.core import parallel_state
    from megatron.core.inference.checkpoint_loading import load_inference_model

    pgc = parallel_state.initialize_model_parallel()
    model, _, _ = load_inference_model(path, pgc)
    with torch.no_grad():
        return model(torch.arange(16)[None] % 64, torch.arange(16)[None])


def test_inference_loads_a_virtual_pipeline_checkpoint_at_any_layout(tmp_path):
    import torch

    vpp, pp1 = str(tmp_path / "vpp"), str(tmp_path / "pp1")
    flags = GPT + ["--train-iters", "3"]
    vpp_layout = PP2 + ["--virtual-pipeline-model-parallel-size", "2"]
    run_distributed(_train, 2, "gpt", flags + vpp_layout + ["--save", vpp], 2, tmp_path / "vpp.jsonl")
    run_distributed(_train, 1, "gpt", flags + ["--save", pp1], 1, tmp_path / "pp1.jsonl")
    at_pp1 = run_distributed(_inference_params, 1, vpp, 1)[0]
    at_pp2 = {}
    for stage_params in run_distributed(_inference_params, 2, vpp, 2):
        at_pp2.update(stage_params)
    assert sorted(at_pp2) == sorted(at_pp1)
    for key, value in at_pp1.items():
        assert torch.equal(at_pp2[key], value), key
    # The VPP checkpoint holds the model the single-process run trained.
    logits = run_distributed(_inference_logits, 1, vpp)[0]
    torch.testing.assert_close(logits, run_distributed(_inference_logits, 1, pp1)[0], rtol=1e-4, atol=1e-5)
