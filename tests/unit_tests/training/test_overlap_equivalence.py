"""Overlapped gradient reduction and parameter gathering change when communication happens,
never what is computed: through the real Trainer and schedules, ``--overlap-grad-reduce``
(and ``--overlap-param-gather``) give bit-identical losses and final parameters to the
same run without them, on DP2, DP2 + distributed optimizer, TP2xDP2 (sequence parallel),
GTP2xDP2 and PP2xDP2 (tied embeddings across stages, four micro-batches);
``--grad-reduce-in-bf16`` stays within bf16 tolerance of the fp32 reduction."""

import pytest
import torch
import torch.distributed as dist

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.initialize import initialize_megatron, set_random_seeds
from megatron.training.training import Trainer, ddp_config_from_args, logging_rank
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve
from tests.unit_tests.training.test_layout_equivalence import COMMON

BUCKET = ["--ddp-bucket-size", "1500"]  # a dozen buckets for this model, so the overlap has something to do
OVERLAP = ["--overlap-grad-reduce"]


def _train(args, pgc):
    set_random_seeds(args.seed, pgc)
    trainer = Trainer(args, pgc)
    trainer.train()
    trainer.logger.close()
    params = {name: p.detach().clone() for name, p in trainer.model.module.named_parameters()}
    buffers = trainer.model.param_and_grad_buffers
    losses = loss_curve(args.metrics_jsonl) if trainer.is_logging_rank else None
    return losses, params, sum(len(b.buckets) for b in buffers), {b.grad_dtype for b in buffers}


def _runs(flag_sets, world_size, tmp_dir):
    """Train once per flag set in one process group; every rank returns whether it is the
    logging rank and, per run, its losses (logging rank only), final parameters, bucket count
    and grad dtypes."""
    args = [
        parse_args(
            COMMON + flags + ["--log-interval", "1", "--metrics-jsonl", f"{tmp_dir}/run{i}.jsonl"],
            model_family="gpt",
            world_size=world_size,
        )
        for i, flags in enumerate(flag_sets)
    ]
    pgc = initialize_megatron(args[0])
    return dist.get_rank() == logging_rank(pgc), [_train(a, pgc) for a in args]


LAYOUTS = {
    "DP2": (2, []),
    "DP2-distopt": (2, ["--use-distributed-optimizer"]),
    "TP2xDP2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "GTP2xDP2": (4, ["--generalized-tensor-parallel-size", "2"]),
    "PP2xDP2-distopt": (
        4,
        ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--global-batch-size", "16"],
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlap_gives_bit_identical_losses_and_parameters(layout, tmp_path):
    world_size, flags = LAYOUTS[layout]
    overlap = OVERLAP + (["--overlap-param-gather"] if "--use-distributed-optimizer" in flags else [])
    results = run_distributed(_runs, world_size, [flags + BUCKET, flags + BUCKET + overlap], world_size, str(tmp_path))
    for is_logging_rank, ((losses_off, params_off, buckets_off, _), (losses_on, params_on, buckets_on, _)) in results:
        assert buckets_on == buckets_off > 1
        assert losses_on == losses_off
        for name, param in params_off.items():
            assert torch.equal(params_on[name], param), name
        if is_logging_rank:
            assert losses_off[-1] < losses_off[0] - 0.1  # it trained


def test_grad_reduce_in_bf16_stays_within_bf16_tolerance_of_fp32_reduction(tmp_path):
    fp32, bf16 = ["--overlap-grad-reduce"] + BUCKET, ["--overlap-grad-reduce", "--grad-reduce-in-bf16"] + BUCKET
    (rank0, (reference, bf16_run)), _ = run_distributed(_runs, 2, [fp32, bf16], 2, str(tmp_path))
    assert rank0 and reference[3] == {torch.float32} and bf16_run[3] == {torch.bfloat16}
    assert bf16_run[0] != reference[0]  # the reduction really ran in bf16
    assert bf16_run[0] == pytest.approx(reference[0], rel=5e-3)
    for name, param in reference[1].items():
        torch.testing.assert_close(bf16_run[1][name], param, rtol=2e-2, atol=2e-3, msg=name)


def test_grad_reduce_in_bf16_replaces_the_fp32_buffer_of_bf16_models():
    assert ddp_config_from_args(parse_args(COMMON + ["--bf16"], world_size=1)).grad_reduce_in_fp32
    config = ddp_config_from_args(parse_args(COMMON + ["--bf16", "--grad-reduce-in-bf16"], world_size=1))
    assert config.grad_reduce_in_bf16 and not config.grad_reduce_in_fp32


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
        (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1, got 0"),
    ],
)
def test_bad_overlap_flags_are_rejected_naming_them(flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(COMMON + flags, world_size=2)
