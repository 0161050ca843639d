"""Command-line flags with Megatron's names, validated before any process group exists.

``parse_args(argv, world_size=...)`` returns an ``argparse.Namespace``; every bad or
contradictory combination raises :class:`ArgumentError` naming the flags at fault, and the
entry points turn that into a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.errors import MegatronConfigError
from megatron.core.models.model_record import ModelRecord, TokenizerRecord


class ArgumentError(MegatronConfigError):
    """A bad or contradictory flag combination; the message names the flags."""


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per virtual pipeline stage (interleaved schedule)",
    )
    g.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help="model chunks (virtual stages) per pipeline rank for the interleaved schedule",
    )
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--generalized-tensor-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="launch each gradient bucket's all-reduce / reduce-scatter during backward",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="all-gather the distributed optimizer's updated parameters during the next forward",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="elements per gradient bucket (default: max(40M, 1M x data-parallel size))",
    )
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="accumulate and reduce gradients in bf16")
    g.add_argument(
        "--distributed-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="default: nccl when CUDA is available, else gloo",
    )
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true", help="accepted for compatibility")
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default=None)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hybrid-layer-pattern", type=str, default=None)
    g.add_argument("--mamba-state-dim", type=int, default=16)
    g.add_argument("--mamba-head-dim", type=int, default=16)
    g.add_argument("--mamba-num-groups", type=int, default=1)
    g.add_argument("--mamba-chunk-size", type=int, default=TransformerConfig.mamba_chunk_size, help="SSD scan chunk")
    g.add_argument("--mtp-num-layers", type=int, default=None)
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument(
        "--use-torch-compile",
        action="store_true",
        help="torch.compile each decoder layer (regional compilation; collectives stay outside)",
    )


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear"
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument(
        "--override-opt-param-scheduler",
        action="store_true",
        help="on --load, use the scheduler flags instead of the checkpoint's",
    )
    g.add_argument(
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="on --load, use the checkpoint's scheduler settings",
    )
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--calculate-per-token-loss", action="store_true")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="indexed dataset prefix(es), or 'builtin' for the bundled corpus (default)",
    )
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--tokenizer-type", type=str, default="ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--eod-mask-loss", action="store_true", help="mask the loss on end-of-document tokens")
    g.add_argument("--vocab-size", type=int, default=None, help="for --mock-data; defaults to the tokenizer's")


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=0)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--metrics-jsonl", type=str, default=None, metavar="PATH")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")


def build_parser(model_family: str, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    _add_parallel_args(parser)
    _add_model_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_logging_and_checkpoint_args(parser)
    parser.set_defaults(model_family=model_family)
    return parser


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the flags against each other and the world size; fill derived values.

    Raises ArgumentError naming the flags at fault. Runs before any process group exists.
    """
    for flag in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "generalized_tensor_parallel_size",
        "micro_batch_size",
        "mamba_chunk_size",
    ):
        _require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    tp, pp, cp, gtp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
        args.generalized_tensor_parallel_size,
    )
    model_parallel = tp * pp * cp * gtp
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
        f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) x "
        f"--generalized-tensor-parallel-size ({gtp}) = {model_parallel}",
    )
    _require(cp == 1, f"--context-parallel-size {cp} is not supported by the models yet; use 1")
    args.data_parallel_size = world_size // model_parallel
    # GTP peers read different micro-batches: they are part of the data-parallel width.
    args.data_parallel_width = args.data_parallel_size * cp * gtp
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters", "lr"):
        _require(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    _require(args.train_iters >= 1, f"--train-iters must be >= 1, got {args.train_iters}")
    _require(
        not args.overlap_param_gather or args.use_distributed_optimizer,
        "--overlap-param-gather needs --use-distributed-optimizer",
    )
    _require(
        args.ddp_bucket_size is None or args.ddp_bucket_size >= 1,
        f"--ddp-bucket-size must be >= 1, got {args.ddp_bucket_size}",
    )
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    _require(not (args.mock_data and args.data_path), "--mock-data and --data-path are mutually exclusive")
    _require(
        args.data_path is None or len(args.data_path) == 1,
        f"--data-path takes one dataset prefix for now (no blending), got {len(args.data_path or [])}",
    )
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_width
    per_step = args.micro_batch_size * args.data_parallel_width
    _require(
        args.global_batch_size % per_step == 0,
        f"--global-batch-size ({args.global_batch_size}) must be a multiple of --micro-batch-size "
        f"({args.micro_batch_size}) x data-parallel width ({args.data_parallel_width} = DP "
        f"{args.data_parallel_size} x CP {cp} x GTP {gtp})",
    )
    args.num_microbatches = args.global_batch_size // per_step
    _validate_virtual_pipeline(args)
    _require(
        args.num_attention_heads % tp == 0,
        f"--num-attention-heads ({args.num_attention_heads}) must be divisible by --tensor-model-parallel-size ({tp})",
    )
    if args.num_query_groups is not None:
        _require(
            args.num_query_groups % tp == 0,
            f"--num-query-groups ({args.num_query_groups}) must be divisible by --tensor-model-parallel-size ({tp})",
        )
        _require(
            args.num_attention_heads % args.num_query_groups == 0,
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by --num-query-groups "
            f"({args.num_query_groups})",
        )
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron's behaviour: nothing to split at TP=1
    if args.position_embedding_type is None:
        args.position_embedding_type = "none" if args.model_family == "hybrid" else "learned_absolute"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(
            args.seq_length <= args.max_position_embeddings,
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings ({args.max_position_embeddings})",
        )
    if args.model_family == "hybrid":
        _require(args.hybrid_layer_pattern is not None, "--hybrid-layer-pattern is required for hybrid models")
    else:
        _require(args.hybrid_layer_pattern is None, "--hybrid-layer-pattern is only valid for hybrid models")
        _require(
            args.num_layers % pp == 0,
            f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})",
        )
    _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require(
        args.lr_warmup_iters <= args.lr_decay_iters,
        f"--lr-warmup-iters ({args.lr_warmup_iters}) must not exceed --lr-decay-iters ({args.lr_decay_iters})",
    )
    _require(
        not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
        "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are mutually exclusive",
    )
    _require(args.save_interval is None or args.save is not None, "--save-interval needs --save")
    _require(args.save_interval is None or args.save_interval >= 1, "--save-interval must be >= 1")
    _require(not (args.finetune and args.load is None), "--finetune needs --load")
    _require(args.log_interval >= 1, f"--log-interval must be >= 1, got {args.log_interval}")
    _require(args.eval_interval is None or args.eval_iters >= 1, "--eval-interval needs --eval-iters >= 1")
    _require(
        args.mtp_num_layers is None or args.mtp_num_layers >= 1,
        f"--mtp-num-layers must be >= 1, got {args.mtp_num_layers}",
    )
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        config = transformer_config_from_args(args)
        if args.model_family == "hybrid":
            from megatron.core.models.hybrid.hybrid_layer_pattern import resolve_hybrid_pattern, select_stage_layers
            from megatron.core.ssm.mamba_mixer import MambaDims

            MambaDims.from_config(config, tp)
            pattern = resolve_hybrid_pattern(
                config.num_layers, config.mtp_num_layers, args.hybrid_layer_pattern, None, None, None
            )
            select_stage_layers(pattern, pp, 0, args.virtual_pipeline_model_parallel_size or 1)
    except ValueError as error:
        raise ArgumentError(f"invalid model flags: {error}") from error
    return args


def _validate_virtual_pipeline(args: argparse.Namespace) -> None:
    """Megatron's virtual-pipeline flags: ``--num-layers-per-virtual-pipeline-stage N`` gives
    ``V = num_layers / PP / N``; ``--virtual-pipeline-model-parallel-size V`` gives V directly.
    Sets ``args.virtual_pipeline_model_parallel_size`` (None: no interleaving, also for V = 1)."""
    pp, per_stage = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    _require(
        per_stage is None or args.virtual_pipeline_model_parallel_size is None,
        "--num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size are mutually exclusive",
    )
    if per_stage is not None:
        _require(per_stage >= 1, f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {per_stage}")
        _require(
            args.num_layers % (pp * per_stage) == 0,
            f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
            f"--num-layers-per-virtual-pipeline-stage ({per_stage})",
        )
        args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * per_stage)
    vp = args.virtual_pipeline_model_parallel_size
    if vp is None:
        return
    _require(vp >= 1, f"--virtual-pipeline-model-parallel-size must be >= 1, got {vp}")
    if vp == 1:
        args.virtual_pipeline_model_parallel_size = None  # one chunk per rank: plain 1F1B
        return
    _require(pp > 1, f"virtual pipeline stages (V = {vp}) need --pipeline-model-parallel-size > 1")
    if args.model_family != "hybrid":
        _require(
            args.num_layers % (pp * vp) == 0,
            f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
            f"virtual pipeline size ({vp}) = {pp * vp}",
        )
    _require(
        args.num_microbatches % pp == 0,
        f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches} = --global-batch-size "
        f"/ (--micro-batch-size x data-parallel width)) to be a multiple of --pipeline-model-parallel-size ({pp})",
    )


def parse_args(
    argv: list[str] | None = None,
    model_family: str = "gpt",
    world_size: int | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (1 without torchrun)."""
    parser = build_parser(model_family)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return validate_args(args, world_size)


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The model configuration the flags describe."""
    return TransformerConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        generalized_tensor_parallel_size=args.generalized_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        calculate_per_token_loss=args.calculate_per_token_loss,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        init_method_std=args.init_method_std,
        init_seed=args.seed,
        mamba_state_dim=args.mamba_state_dim,
        mamba_head_dim=args.mamba_head_dim,
        mamba_num_groups=args.mamba_num_groups,
        mamba_chunk_size=args.mamba_chunk_size,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        recompute_granularity=args.recompute_granularity,
    )


def model_record_from_args(args: argparse.Namespace, vocab_size: int) -> ModelRecord:
    """The model record of a run started from the pretraining flags: built once, it is what
    the trainer builds the model from and what its checkpoints store."""
    return ModelRecord(
        family=args.model_family,
        config=transformer_config_from_args(args),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        layer_pattern=args.hybrid_layer_pattern,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        tokenizer=TokenizerRecord(args.tokenizer_type, args.tokenizer_model),
    )
