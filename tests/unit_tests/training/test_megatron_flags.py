"""Megatron's command-line surface, before any process group: its defaults, the flags that only
select what is always used (accepted, noted once), the refused ones (named, with what to use
instead), the sample-based schedule, and the flags with meaning (recompute, zero-centered norms)."""

import logging
import re

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.optimizer import build_grad_scaler
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.transformer.norms import LayerNorm, RMSNorm
from megatron.training.arguments import (
    IMPLEMENTATION_FLAGS,
    ArgumentError,
    build_parser,
    optimizer_config_from_args,
    parse_args,
    transformer_config_from_args,
)
from tests.unit_tests.training.test_arguments import BASE

# Megatron-LM's defaults (megatron/training/arguments.py and the config dataclasses it builds
# flags from); each must be ours too.
MEGATRON_DEFAULTS = {
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "mamba_state_dim": 128,
    "mamba_head_dim": 64,
    "mamba_num_groups": 8,
    "mamba_chunk_size": 128,
    "initial_loss_scale": 2.0**32,
    "loss_scale": None,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "log_params_norm": False,
    "log_num_zeros_in_grad": False,
    "make_vocab_size_divisible_by": 128,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "add_qkv_bias": False,
    "mamba_num_heads": None,
    "log_interval": 100,
    "eval_iters": 100,
    "eval_interval": None,
    "seed": 1234,
    "weight_decay": 0.01,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "clip_grad": 1.0,
    "init_method_std": 0.02,
    "norm_epsilon": 1e-5,
    "normalization": "LayerNorm",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "lr_decay_style": "linear",
    "min_lr": 0.0,
    "lr_warmup_init": 0.0,
    "lr_warmup_iters": 0,
    "lr_warmup_samples": 0,
    "lr_warmup_fraction": None,
    "train_samples": None,
    "exit_interval": None,
    "exit_duration_in_mins": None,
    "manual_gc": False,
    "manual_gc_interval": 0,
    "manual_gc_eval": True,
    "mtp_loss_scaling_factor": 0.1,
    "distributed_timeout_minutes": 10,
    "optimizer": "adam",
    "sgd_momentum": 0.9,
    "profile_step_start": 10,
    "profile_step_end": 12,
    "profile_ranks": [0],
}


def test_defaults_are_megatrons():
    parser = build_parser("gpt")
    assert {dest: parser.get_default(dest) for dest in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS


def _args(*extra, family="gpt", world=1):
    return parse_args(BASE + list(extra), model_family=family, world_size=world)


@pytest.mark.parametrize(
    "extra",
    [
        ["--use-mcore-models"],
        ["--transformer-impl", "local"],
        ["--transformer-impl", "transformer_engine"],
        ["--use-flash-attn"],
        ["--no-masked-softmax-fusion"],
        ["--cross-entropy-loss-fusion"],
        ["--no-create-attention-mask-in-dataloader"],
        ["--log-throughput"],
        ["--num-workers", "1"],
        ["--no-mmap-bin-files"],
        ["--ckpt-format", "torch_dist"],
        ["--ckpt-format", "torch"],
        ["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
        ["--group-query-attention"],
        ["--use-checkpoint-args"],
        ["--attention-softmax-in-fp32"],
        ["--apply-query-key-layer-scaling"],
        ["--no-persist-layer-norm"],
        ["--timing-log-level", "2"],
        ["--timing-log-option", "minmax"],
        ["--log-timers-to-tensorboard"],
        ["--log-validation-ppl-to-tensorboard"],
        ["--log-memory-to-tensorboard"],
        ["--tensorboard-log-interval", "1"],
        ["--tensorboard-queue-size", "1000"],
        ["--wandb-project", "p"],
        ["--wandb-exp-name", "e"],
        ["--wandb-save-dir", "d"],
        ["--wandb-entity", "x"],
        ["--ckpt-fully-parallel-save"],
        ["--ckpt-fully-parallel-load"],
        ["--use-persistent-ckpt-worker"],
        ["--ckpt-assume-constant-structure"],
        ["--auto-detect-ckpt-format"],
        ["--dist-ckpt-strictness", "log_all"],
        ["--dist-ckpt-optim-fully-reshardable"],
        ["--no-ckpt-fully-parallel-save"],
        ["--accumulate-allreduce-grads-in-fp32"],
        ["--moe-router-dtype", "fp32"],
        ["--moe-permute-fusion"],
        ["--dataloader-type", "single"],
        ["--verify-integrity"],
        ["--async-strategy", "mcore"],
        ["--ddp-average-in-collective"],
        ["--defer-embedding-wgrad-compute"],
        ["--wgrad-deferral-limit", "2"],
        ["--overlap-p2p-communication"],
        ["--overlap-p2p-communication-warmup-flush"],
        ["--async-ckpt-use-cpu-shm"],
        ["--disable-gloo-process-groups"],
        ["--overlap-param-gather-with-optimizer-step"],
        ["--overlap-moe-expert-parallel-comm"],
        ["--use-transformer-engine-op-fuser"],
    ],
)
def test_implementation_flags_are_accepted_and_noted_once(extra):
    notes = _args(*extra).compatibility_notes
    assert len(notes) == 1 and notes[0].startswith(" ".join(extra[:2] if extra[0] != "--spec" else extra))
    assert _args().compatibility_notes == []


def test_timing_level_zero_is_what_runs_and_needs_no_note():
    assert _args("--timing-log-level", "0").compatibility_notes == []


def test_the_flash_attention_note_says_what_is_used():
    assert _args("--use-flash-attn").compatibility_notes == ["--use-flash-attn: attention already uses fused SDPA"]
    assert set(IMPLEMENTATION_FLAGS) >= {"--use-mcore-models", "--transformer-impl"}


def test_the_hybrid_spec_of_megatrons_mamba_example_is_accepted():
    spec = ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]
    mamba = ["--mamba-head-dim", "8", "--mamba-state-dim", "8", "--mamba-num-groups", "1"]
    args = _args(*spec, *mamba, "--hybrid-layer-pattern", "M*M-", family="hybrid")
    assert args.compatibility_notes == [
        "--spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec: the hybrid layer spec built here"
    ]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--fp8-format", "hybrid"], "--fp8-format: fp8 training is not supported; train in --bf16"),
        (["--fp8-param-gather"], "--fp8-param-gather: fp8 training is not supported"),
        (
            ["--spec", "my.module", "my_spec"],
            r"--spec my.module my_spec: gpt models are built from this framework's own layer spec",
        ),
        (["--tokenizer-type", "TikTokenizer"], "unknown tokenizer type 'TikTokenizer'; accepted --tokenizer-type"),
        (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size"),
        (
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"],
            "NullTokenizer cannot tokenize the built-in corpus; use --mock-data or --data-path",
        ),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "nope.json"], "--vocab-file nope.json: no such file"),
        (
            ["--tokenizer-type", "ByteLevelTokenizer", "--vocab-file", "v.json"],
            "--tokenizer-type ByteLevelTokenizer does not read --vocab-file",
        ),
        (["--vocab-file", "v.json"], "--vocab-file v.json: no such file"),  # GPT2BPETokenizer, Megatron's default
        (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations is selective"),
        (["--recompute-method", "uniform"], "^--recompute-method needs --recompute-granularity full$"),
        (["--save-retain-interval", "2"], "^--save-retain-interval needs --save$"),
        (["--use-torch-fsdp2"], "^--use-torch-fsdp2: FSDP is not supported; .*--use-distributed-optimizer"),
        (["--use-megatron-fsdp"], "^--use-megatron-fsdp: FSDP is not supported"),
        (["--tp-comm-overlap"], "^--tp-comm-overlap: Transformer Engine's .* is not supported"),
        (["--hierarchical-context-parallel-sizes", "2", "2"], "^--hierarchical-context-parallel-sizes: hierarchical"),
        (["--use-legacy-models"], "^--use-legacy-models: the legacy models are not supported"),
        (
            ["--check-weight-hash-across-dp-replicas-interval", "0"],
            "^--check-weight-hash-across-dp-replicas-interval must be >= 1, got 0$",
        ),
        (
            ["--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"],
            "^--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 are mutually exclusive$",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
            "^--recompute-num-layers needs --recompute-granularity full$",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-num-layers", "0"],
            "^--recompute-num-layers must be >= 1, got 0$",
        ),
        (["--manual-gc-interval", "5"], "--manual-gc-interval needs --manual-gc"),
        (["--data-path", "a", "--train-data-path", "b"], "--train-data-path and --data-path are mutually exclusive"),
        (["--valid-data-path", "b"], "--valid-data-path / --test-data-path need --train-data-path"),
        (["--data-path", "0.5", "builtin", "0.5", "a"], "'builtin' .* cannot be blended"),
    ],
)
def test_refused_flags_name_the_flag_and_what_to_use(extra, message):
    world = 2 if "--context-parallel-size" in extra else 1
    with pytest.raises(ArgumentError, match=message):
        _args(*extra, world=world)


@pytest.mark.parametrize(
    "extra,world,virtual",
    [
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2, 2),
        (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"], 2, 2),
        (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], 2, 2),
    ],
)
def test_virtual_stages_select_the_interleaved_schedule(extra, world, virtual):
    assert _args(*extra, "--global-batch-size", "4", world=world).virtual_pipeline_model_parallel_size == virtual


def test_virtual_stages_without_pipeline_parallelism_are_refused():
    with pytest.raises(
        ArgumentError, match=r"virtual pipeline stages \(V = 4\) need --pipeline-model-parallel-size > 1"
    ):
        _args("--num-virtual-stages-per-pipeline-rank", "4")


def test_one_virtual_stage_per_rank_is_the_1f1b_schedule_and_says_so():
    args = _args("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2", world=2)
    assert args.compatibility_notes == [
        "--num-layers-per-virtual-pipeline-stage 2: one virtual stage per pipeline rank, the 1F1B schedule"
    ]


def test_sample_based_schedule_becomes_iterations_of_the_global_batch():
    train = [a for a in BASE if a not in ("--train-iters", "10")]
    args = parse_args(
        train
        + ["--global-batch-size", "8", "--train-samples", "100", "--lr-warmup-samples", "12"]
        + ["--lr-decay-samples", "88"],
        world_size=1,
    )
    assert (args.train_iters, args.lr_warmup_iters, args.lr_decay_iters) == (12, 1.5, 11)
    fraction = parse_args(train + ["--global-batch-size", "8", "--train-samples", "80", "--lr-warmup-fraction", "0.25"])
    assert (fraction.train_iters, fraction.lr_decay_iters, fraction.lr_warmup_iters) == (10, 10, 2.5)
    iterations = _args("--lr-warmup-fraction", "0.1", "--lr-decay-iters", "5")
    assert iterations.lr_warmup_iters == 0.5


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--train-samples", "80"], "--train-iters and --train-samples are mutually exclusive"),
        (["--lr-warmup-samples", "8"], "--lr-warmup-samples needs sample-based training .* use --lr-warmup-iters"),
        (["--lr-decay-samples", "8"], "--lr-decay-samples needs sample-based training .* use --lr-decay-iters"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction and --lr-warmup-iters"),
        (["--lr-warmup-fraction", "1.5"], r"--lr-warmup-fraction must be in \[0, 1\]"),
        (["--exit-interval", "0"], "--exit-interval must be >= 1"),
    ],
)
def test_schedule_flags_follow_megatrons_exclusions(extra, message):
    with pytest.raises(ArgumentError, match=message):
        _args(*extra)


def test_sample_flags_refuse_iteration_forms():
    train = [a for a in BASE if a not in ("--train-iters", "10")]
    with pytest.raises(ArgumentError, match="--lr-warmup-iters needs iteration-based training .* --lr-warmup-samples"):
        parse_args(train + ["--train-samples", "80", "--lr-warmup-iters", "2"], world_size=1)


def test_gpt2_bpe_files_select_megatrons_default_tokenizer(tmp_path):
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("{}")
    files = ["--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")]
    assert _args(*files).tokenizer_type == "GPT2BPETokenizer"
    assert _args().tokenizer_type == "ByteLevelTokenizer"


def test_recompute_activations_is_selective_recompute():
    assert _args("--recompute-activations").recompute_granularity == "selective"
    assert transformer_config_from_args(_args("--recompute-activations")).recompute_granularity == "selective"


def test_hybrid_depth_comes_from_the_pattern_as_in_megatron():
    i = BASE.index("--num-layers")
    base = BASE[:i] + BASE[i + 2 :]
    mamba = ["--mamba-head-dim", "8", "--mamba-state-dim", "8", "--mamba-num-groups", "1"]
    args = parse_args(base + mamba + ["--hybrid-layer-pattern", "M-M*-/*-"], model_family="hybrid", world_size=1)
    assert (args.num_layers, args.mtp_num_layers) == (5, 1)


@pytest.mark.parametrize("norm_class", [LayerNorm, RMSNorm])
def test_apply_layernorm_1p_stores_the_offset_from_one(norm_class):
    config = transformer_config_from_args(_args("--apply-layernorm-1p"))
    assert config.layernorm_zero_centered_gamma
    zero_centered = norm_class(config, 32)
    standard = norm_class(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4), 32)
    assert torch.equal(zero_centered.weight, torch.zeros(32))
    with torch.no_grad():
        zero_centered.weight.uniform_(-0.5, 0.5)
        standard.weight.copy_(zero_centered.weight + 1)
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    torch.testing.assert_close(zero_centered(x), standard(x), rtol=0, atol=0)
    # the layers' fused residual-add + norm path scales the same way (no dropout in eval)
    zero_centered.eval(), standard.eval()
    fused = zero_centered.add_and_norm(x, None, residual, config)
    expected = standard.add_and_norm(x, None, residual, config)
    for got, want in zip(fused, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_non_default_arguments_are_listed_for_the_summary():
    args = _args("--use-flash-attn", "--hidden-dropout", "0.0")
    assert args.non_default_args["--hidden-dropout"] == 0.0 and args.non_default_args["--use-flash-attn"] is True
    assert "--attention-dropout" not in args.non_default_args


def test_loss_scale_flags_reach_the_scaler():
    dynamic = build_grad_scaler(
        optimizer_config_from_args(
            _args("--fp16", "--min-loss-scale", "4", "--loss-scale-window", "10", "--hysteresis", "3")
        )
    )
    assert type(dynamic) is DynamicGradScaler
    assert (dynamic.min_scale, dynamic.growth_interval, dynamic.hysteresis) == (4.0, 10, 3)
    constant = build_grad_scaler(optimizer_config_from_args(_args("--bf16", "--loss-scale", "1024")))
    assert type(constant) is ConstantGradScaler and constant.scale == 1024.0
    assert optimizer_config_from_args(_args("--log-num-zeros-in-grad")).log_num_zeros_in_grad


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hysteresis", "0"], "invalid optimizer flags: hysteresis must be an integer >= 1, got 0"),
        (["--loss-scale", "-1"], "invalid optimizer flags: loss_scale must be None"),
        (["--weight-decay", "-0.1"], "invalid optimizer flags: weight_decay must be >= 0, got -0.1"),
    ],
)
def test_bad_optimizer_flags_fail_before_any_process_group(extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _args(*extra)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--use-rotary-position-embeddings"], "rope"),
        (["--no-position-embedding"], "none"),
        (["--no-position-embedding", "--use-rotary-position-embeddings"], "rope"),
        (["--position-embedding-type", "rope", "--no-position-embedding"], "rope"),
    ],
)
def test_megatrons_older_position_embedding_flags(extra, expected):
    assert _args(*extra).position_embedding_type == expected


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
            "--use-rotary-position-embeddings contradicts --position-embedding-type learned_absolute",
        ),
        (
            ["--no-position-embedding", "--position-embedding-type", "learned_absolute"],
            "--no-position-embedding contradicts --position-embedding-type learned_absolute",
        ),
    ],
)
def test_contradicting_position_embedding_flags_are_refused(extra, message):
    with pytest.raises(ArgumentError, match=f"^{message}$"):
        _args(*extra)


@pytest.mark.parametrize("spelling", ["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"])
def test_megatrons_underscore_spellings_of_the_scheduler_flags(spelling):
    dest = "use_checkpoint_opt_param_scheduler" if "use" in spelling else "override_opt_param_scheduler"
    assert getattr(_args(spelling), dest) is True


@pytest.mark.parametrize(
    "extra, disabled",
    [
        ([], []),
        (["--no-rope-fusion"], ["rope"]),
        (["--no-bias-gelu-fusion"], ["activation"]),
        (["--swiglu", "--no-bias-gelu-fusion"], []),  # the switch of an activation the model does not use
        (["--swiglu", "--no-bias-swiglu-fusion"], ["activation"]),
        (["--no-bias-dropout-fusion", "--no-rope-fusion"], ["rope", "bias_dropout_add"]),
    ],
)
def test_fusion_flags_name_the_ops_they_send_to_the_torch_path(extra, disabled):
    assert _args(*extra).disabled_fusions == disabled


def _configure_and_report(argv):
    import os

    from megatron.core.fusions import disabled_ops
    from megatron.training.initialize import configure_process

    configure_process(parse_args(BASE + argv, model_family="gpt", world_size=1))
    env = {name: os.environ.get(name) for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")}
    return torch.are_deterministic_algorithms_enabled(), env, sorted(disabled_ops()), logging.getLogger().level


def test_deterministic_mode_and_fusion_flags_configure_the_process():
    from tests.unit_tests.dist_harness import run_distributed

    argv = ["--deterministic-mode", "--no-rope-fusion", "--no-bias-dropout-fusion", "--logging-level", "40"]
    ((deterministic, env, disabled, level),) = run_distributed(_configure_and_report, 1, argv)
    assert deterministic and env == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert disabled == ["bias_dropout_add", "rope"] and level == logging.ERROR
    ((deterministic, _, disabled, level),) = run_distributed(_configure_and_report, 1, [])
    assert not deterministic and disabled == [] and level != logging.ERROR


def test_squared_relu_is_the_mlp_activation():
    from megatron.core.activations import squared_relu

    assert transformer_config_from_args(_args("--squared-relu")).activation_func is squared_relu
    with pytest.raises(ArgumentError, match="^--squared-relu and --swiglu are mutually exclusive$"):
        _args("--squared-relu", "--swiglu")


def test_make_vocab_size_divisible_by_must_be_positive():
    with pytest.raises(ArgumentError, match="^--make-vocab-size-divisible-by must be >= 1, got 0$"):
        _args("--make-vocab-size-divisible-by", "0")


def test_hybrid_override_pattern_is_the_older_name_of_the_pattern():
    mamba = ["--mamba-head-dim", "8", "--mamba-state-dim", "8", "--mamba-num-groups", "1"]
    args = _args(*mamba, "--hybrid-override-pattern", "M*M-", family="hybrid")
    assert (args.hybrid_layer_pattern, args.num_layers) == ("M*M-", 4)
    with pytest.raises(ArgumentError, match="^--hybrid-override-pattern is the older name of --hybrid-layer-pattern"):
        _args(*mamba, "--hybrid-override-pattern", "M*M-", "--hybrid-layer-pattern", "M*M-", family="hybrid")


def test_megatrons_full_recompute_flags_reach_the_config():
    args = _args("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")
    config = transformer_config_from_args(args)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 1)


def test_model_flags_of_megatron_reach_the_model_record():
    from megatron.training.arguments import model_record_from_args

    gpt = model_record_from_args(_args("--add-qkv-bias", "--use-rope-scaling", "--rope-scaling-factor", "32"), 64)
    assert gpt.config.add_qkv_bias and (gpt.rope_scaling, gpt.rope_scaling_factor) == (True, 32.0)
    assert not gpt.config.rotary_interleaved
    rope = ["--position-embedding-type", "rope"]
    assert model_record_from_args(_args(*rope, "--rotary-interleaved"), 64).config.rotary_interleaved
    with pytest.raises(ArgumentError, match=r"^--rotary-interleaved needs --position-embedding-type rope \(got "):
        _args("--rotary-interleaved")
    mamba = ["--mamba-head-dim", "8", "--mamba-state-dim", "8", "--mamba-num-groups", "1"]
    hybrid_args = _args(*mamba, "--hybrid-layer-pattern", "M*M*", "--mamba-num-heads", "6", family="hybrid")
    assert model_record_from_args(hybrid_args, 64).config.mamba_num_heads == 6
    with pytest.raises(ArgumentError, match="^--use-rope-scaling is for GPT models"):
        _args(*mamba, "--hybrid-layer-pattern", "M*M*", "--use-rope-scaling", family="hybrid")


def test_the_micro_batch_group_size_of_the_interleaved_schedule_defaults_to_the_pipeline_size():
    pipeline = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]
    assert _args(*pipeline, "--global-batch-size", "4", world=2).microbatch_group_size_per_virtual_pipeline_stage == 2
    extra = [*pipeline, "--global-batch-size", "6", "--microbatch-group-size-per-virtual-pipeline-stage", "3"]
    assert _args(*extra, world=2).microbatch_group_size_per_virtual_pipeline_stage == 3


@pytest.mark.parametrize(
    "extra, world, ends",
    [
        (["--decoder-first-pipeline-num-layers", "1"], 2, (1, None)),
        (["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"], 3, (1, 1)),
        (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"], 2, (2, 2)),
        (["--account-for-embedding-in-pipeline-split"], 2, None),
    ],
)
def test_megatrons_uneven_pipeline_split(extra, world, ends):
    """4 layers: the account-for flags count the embedding and the loss as layers of the ends'
    even share ((4 + 2) / 2 = 3 each: 2 layers on each end)."""
    flags = ["--pipeline-model-parallel-size", str(world), "--global-batch-size", "4", *extra]
    if ends is None:
        with pytest.raises(ArgumentError, match=r"^--num-layers \(4\) plus the 1 accounted for must be divisible"):
            _args(*flags, world=world)
        return
    assert _args(*flags, world=world).stage_ends == ends


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--decoder-first-pipeline-num-layers", "4"], "^invalid model flags: num_layers \\(4\\) less the first"),
        (
            ["--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"],
            "^--account-for-embedding/loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers are "
            "mutually exclusive$",
        ),
    ],
)
def test_uneven_pipeline_splits_that_do_not_fit_are_refused(extra, message):
    flags = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", *extra]
    with pytest.raises(ArgumentError, match=message):
        _args(*flags, world=2)
    with pytest.raises(ArgumentError, match="need --pipeline-model-parallel-size > 1 and no virtual"):
        _args("--decoder-first-pipeline-num-layers", "1")
