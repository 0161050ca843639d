"""Flag validation: every bad combination fails before any process group, naming the flags."""

import pytest

from megatron.training.arguments import ArgumentError, parse_args, transformer_config_from_args

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--micro-batch-size",
    "2",
]


def test_valid_flags_derive_data_parallel_width_and_microbatches():
    args = parse_args(
        BASE
        + ["--tensor-model-parallel-size", "2", "--generalized-tensor-parallel-size", "2", "--global-batch-size", "16"],
        world_size=8,
    )
    assert args.data_parallel_size == 2
    assert args.data_parallel_width == 4  # DP x GTP: GTP peers read different micro-batches
    assert args.num_microbatches == 2
    config = transformer_config_from_args(args)
    assert config.tensor_model_parallel_size == 2 and config.generalized_tensor_parallel_size == 2


def test_speed_flags_reach_the_config():
    args = parse_args(BASE + ["--use-torch-compile", "--mamba-chunk-size", "64"], world_size=1)
    assert args.use_torch_compile and transformer_config_from_args(args).mamba_chunk_size == 64
    default = parse_args(BASE, world_size=1)
    assert not default.use_torch_compile and transformer_config_from_args(default).mamba_chunk_size == 128  # Megatron's
    assert default.cross_entropy_fusion_impl == "native"
    assert (
        parse_args(BASE + ["--cross-entropy-fusion-impl", "linear"], world_size=1).cross_entropy_fusion_impl == "linear"
    )


def test_gradient_accumulation_fusion_is_on_by_default_and_reaches_the_config():
    default = parse_args(BASE, world_size=1)
    assert default.gradient_accumulation_fusion and transformer_config_from_args(default).gradient_accumulation_fusion
    off = parse_args(BASE + ["--no-gradient-accumulation-fusion"], world_size=1)
    assert not off.gradient_accumulation_fusion and not transformer_config_from_args(off).gradient_accumulation_fusion


def test_sequence_parallel_is_dropped_at_tp1():
    assert parse_args(BASE + ["--sequence-parallel"], world_size=1).sequence_parallel is False


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (
            ["--tensor-model-parallel-size", "3"],
            4,
            r"world size 4 is not divisible by --tensor-model-parallel-size \(3\) .* = 3",
        ),
        (
            ["--global-batch-size", "6"],
            4,
            r"--global-batch-size \(6\) must be a multiple of --micro-batch-size \(2\) x data-parallel width \(4",
        ),
        (["--bf16", "--fp16"], 1, "--bf16 and --fp16 are mutually exclusive"),
        (["--mock-data", "--data-path", "x"], 1, "--mock-data and --data-path are mutually exclusive"),
        (["--data-path", "0.3", "a", "0.7"], 1, r"--data-path takes weight-prefix pairs, got an odd number"),
        (
            ["--tensor-model-parallel-size", "8"],
            8,
            r"--num-attention-heads \(4\) must be divisible by --tensor-model-parallel-size \(8\)",
        ),
        (
            ["--pipeline-model-parallel-size", "3"],
            3,
            r"--num-layers \(4\) must be divisible by --pipeline-model-parallel-size \(3\)",
        ),
        (["--min-lr", "1"], 1, r"--min-lr \(1.0\) must not exceed --lr \(0.001\)"),
        (["--lr-warmup-iters", "20"], 1, r"--lr-warmup-iters \(20\) must not exceed --lr-decay-iters \(10\)"),
        (["--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--finetune"], 1, "--finetune needs --load"),
        (
            ["--context-parallel-size", "3", "--attention-dropout", "0"],
            3,
            r"--seq-length \(16\) must be divisible by 2 x --context-parallel-size \(6\): each CP rank holds two",
        ),
        (["--hybrid-layer-pattern", "M*"], 1, "--hybrid-layer-pattern is only valid for hybrid models"),
        (["--num-query-groups", "3"], 1, r"--num-attention-heads \(4\) must be divisible by --num-query-groups \(3\)"),
        (
            ["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "8"],
            1,
            r"--seq-length \(16\) exceeds --max-position-embeddings \(8\)",
        ),
        (["--eval-interval", "0"], 1, "--eval-interval must be >= 1, got 0"),
        (["--mamba-chunk-size", "0"], 1, r"--mamba-chunk-size must be >= 1, got 0"),
        (
            ["--expert-model-parallel-size", "3"],
            4,
            r"--expert-model-parallel-size \(3\) x --expert-tensor-parallel-size \(1\) = 3 must divide the "
            r"TP x CP x DP = 4 ranks of a pipeline stage",
        ),
        (
            ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
            2,
            r"--expert-model-parallel-size \(2\) x --expert-tensor-parallel-size \(2\) = 4 must divide the "
            r"TP x CP x DP = 2 ranks",
        ),
        (["--expert-tensor-parallel-size", "0"], 1, "--expert-tensor-parallel-size must be >= 1, got 0"),
        (
            ["--generalized-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"],
            4,
            "--expert-model-parallel-size / --expert-tensor-parallel-size need --generalized-tensor-parallel-size 1",
        ),
        (
            ["--ffn-hidden-size", "33", "--tensor-model-parallel-size", "2"],
            2,
            r"invalid model flags: ffn_hidden_size \(33\) must be divisible by tensor_model_parallel_size \(2\)",
        ),
    ],
)
def test_invalid_combinations_fail_with_the_flags_named(extra, world, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(BASE + extra, world_size=world)


def test_expert_tensor_parallel_size_defaults_to_the_tensor_parallel_size():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"], world_size=8)
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (2, 2)
    args = parse_args(BASE + ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"], world_size=8)
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (4, 2)
    assert parse_args(BASE, world_size=1).expert_tensor_parallel_size == 1


def test_context_parallel_peers_share_micro_batches():
    flags = ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--attention-dropout", "0"]
    args = parse_args(BASE + flags, world_size=4)
    assert (args.data_parallel_size, args.data_parallel_width) == (2, 2)  # DP 2 x GTP 1: CP peers share
    assert parse_args(BASE, world_size=1).cp_comm_type == "p2p"


def test_missing_required_flag_is_named():
    with pytest.raises(ArgumentError, match=r"--train-iters \(or --train-samples\) is required"):
        parse_args([a for a in BASE if a not in ("--train-iters", "10")], world_size=1)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--hybrid-layer-pattern", "M*M-", "--tensor-model-parallel-size", "2"],
            r"invalid model flags: mamba_num_groups \(1\) must be divisible by tensor_model_parallel_size \(2\)",
        ),
        (["--hybrid-layer-pattern", "M*X-"], "invalid model flags: .*'X'"),
        (["--hybrid-layer-pattern", "M*M"], "invalid model flags: .*"),
    ],
)
def test_hybrid_flags_are_checked_before_any_process_group(extra, message):
    world = 2 if "--tensor-model-parallel-size" in extra else 1
    mamba = ["--mamba-head-dim", "8", "--mamba-state-dim", "8", "--mamba-num-groups", "1"]
    with pytest.raises(ArgumentError, match=message):
        parse_args(BASE + mamba + extra, model_family="hybrid", world_size=world)


def test_hybrid_requires_a_pattern():
    with pytest.raises(ArgumentError, match="--hybrid-layer-pattern is required"):
        parse_args(BASE, model_family="hybrid", world_size=1)
