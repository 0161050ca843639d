"""``--load`` without model flags: the checkpoint's model record supplies them.

Before any process group exists, :func:`apply_checkpoint_record` reads the record of the
checkpoint ``--load`` names (plain JSON) and fills every model flag the command line did not
give. A model flag the command line did give must agree with the record (an error names both
values); layout flags (TP, PP, GTP, CP, sequence parallelism) may differ, which is
resharding; training behaviour (dropout, precision, recompute) follows the flags when given.
A ``--load`` directory that holds no checkpoint yet starts the run from scratch, as in
Megatron (``--save X --load X`` resumes whenever there is something to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from megatron.core.activations import squared_relu
from megatron.core.config import MLA_FIELDS
from megatron.core.dist_checkpointing import read_latest_iteration
from megatron.core.models.model_record import (
    MODEL_RECORD_FILENAME,
    ModelRecord,
    TokenizerRecord,
    read_model_record,
    resolve_checkpoint_dir,
)

# Training behaviour kept in the record's config: taken from it unless the flag is given.
BEHAVIOUR_ARGS = {
    "hidden_dropout": "hidden_dropout",
    "attention_dropout": "attention_dropout",
    "init_method_std": "init_method_std",
    "mtp_loss_scaling_factor": "mtp_loss_scaling_factor",
    "recompute_granularity": "recompute_granularity",
    "recompute_modules": "recompute_modules",
    "mamba_chunk_size": "mamba_chunk_size",
    "bf16": "bf16",
    "fp16": "fp16",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_router_bias_update_rate": "moe_router_bias_update_rate",
    "moe_expert_capacity_factor": "moe_expert_capacity_factor",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type",
    "moe_grouped_gemm": "moe_grouped_gemm",
}


def record_model_args(record: ModelRecord) -> dict[str, object]:
    """The model flags (argparse destinations) that describe ``record``'s model."""
    config = record.config
    values = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups,
        "ffn_hidden_size": config.ffn_hidden_size,
        "kv_channels": config.kv_channels,
        "max_position_embeddings": record.max_sequence_length,
        "position_embedding_type": record.position_embedding_type,
        "rotary_base": record.rotary_base,
        "rotary_percent": record.rotary_percent,
        "normalization": config.normalization,
        "norm_epsilon": config.layernorm_epsilon,
        "swiglu": config.gated_linear_unit,
        "disable_bias_linear": not config.add_bias_linear,
        "untie_embeddings_and_output_weights": not record.share_embeddings_and_output_weights,
        "apply_layernorm_1p": config.layernorm_zero_centered_gamma,
        "add_qkv_bias": config.add_qkv_bias,
        "qk_layernorm": config.qk_layernorm,
        "rotary_interleaved": config.rotary_interleaved,
        "multi_latent_attention": config.multi_latent_attention,
        **({name: getattr(config, name) for name in MLA_FIELDS} if config.multi_latent_attention else {}),
        "rotary_scaling_factor": config.yarn_rotary_scaling_factor or 1.0,
        "mscale": config.yarn_mscale,
        "mscale_all_dim": config.yarn_mscale_all_dim,
        "squared_relu": config.activation_func is squared_relu and not config.gated_linear_unit,
        "mtp_num_layers": config.mtp_num_layers or None,
        "vocab_size": record.vocab_size,
        "num_experts": config.num_moe_experts,
        "moe_layer_freq": config.moe_layer_freq,
        "moe_router_topk": config.moe_router_topk,
        "moe_ffn_hidden_size": config.moe_ffn_hidden_size if config.num_moe_experts else None,
        "moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
        "moe_router_score_function": config.moe_router_score_function,
        "moe_router_pre_softmax": config.moe_router_pre_softmax,
        "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
        "moe_router_num_groups": config.moe_router_num_groups,
        "moe_router_group_topk": config.moe_router_group_topk,
        "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor,
    }
    if record.family == "hybrid":
        values.update(
            hybrid_layer_pattern=record.layer_pattern,
            mamba_state_dim=config.mamba_state_dim,
            mamba_head_dim=config.mamba_head_dim,
            mamba_num_groups=config.mamba_num_groups,
            mamba_num_heads=config.mamba_num_heads,
        )
    else:
        values.update(use_rope_scaling=record.rope_scaling, rope_scaling_factor=record.rope_scaling_factor)
    return values


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def checkpoint_record(load: str | None) -> ModelRecord | None:
    """The model record of the checkpoint in ``load``; None when there is no checkpoint yet,
    or when it records no model (e.g. a MIMO run's)."""
    if load is None or read_latest_iteration(load) is None:
        return None
    if not os.path.isfile(os.path.join(resolve_checkpoint_dir(load), MODEL_RECORD_FILENAME)):
        return None
    return read_model_record(load)


def apply_checkpoint_record(args: argparse.Namespace, explicit: set[str], error: type[Exception]) -> None:
    """Fill ``args`` from the record of ``args.load`` (see the module docstring); ``explicit``
    holds the destinations given on the command line. Sets ``args.checkpoint_record`` (None
    without a checkpoint) and raises ``error`` naming every contradicting flag."""
    try:
        record = checkpoint_record(args.load)
    except (ValueError, OSError) as exc:  # an unreadable or unknown record
        raise error(f"--load {args.load}: {exc}") from exc
    args.checkpoint_record = record
    if args.load is not None and args.finetune and read_latest_iteration(args.load) is None:
        raise error(
            f"--finetune --load {args.load}: there is no checkpoint there (no latest_checkpointed_iteration.txt)"
        )
    if record is None:
        return
    if record.family != args.model_family:
        raise error(
            f"--load {args.load} holds a {record.family} model; train it with megatron-pretrain-{record.family}"
        )
    recorded = record_model_args(record)
    contradictions = []
    for dest, value in recorded.items():
        if dest not in explicit:
            setattr(args, dest, value)
        elif getattr(args, dest) != value:
            contradictions.append(f"{_flag(dest)} {getattr(args, dest)} (checkpoint: {value})")
    if contradictions:
        raise error(
            f"--load {args.load}: the model flags contradict the checkpoint's model: {', '.join(contradictions)}; "
            "drop them (the checkpoint's model record gives them) or load another checkpoint"
        )
    for dest, field in BEHAVIOUR_ARGS.items():
        if dest not in explicit:
            setattr(args, dest, getattr(record.config, field))
    if "recompute_granularity" in explicit and "recompute_modules" not in explicit:
        args.recompute_modules = None  # the checkpoint's parts were of its own granularity
    if "seq_length" not in explicit:
        args.seq_length = record.max_sequence_length
    tokenizer = record.tokenizer
    if tokenizer is not None:
        if "tokenizer_type" not in explicit:
            args.tokenizer_type, args.tokenizer_model = tokenizer.type, tokenizer.model
            args.vocab_file, args.merge_file = tokenizer.vocab_file, tokenizer.merge_file
        elif args.tokenizer_type != tokenizer.type:
            raise error(
                f"--load {args.load}: --tokenizer-type {args.tokenizer_type} contradicts the checkpoint's "
                f"{tokenizer.type}; drop it (the checkpoint carries its tokenizer)"
            )


def record_for_run(args: argparse.Namespace, record: ModelRecord, tokenizer: TokenizerRecord) -> ModelRecord:
    """The checkpoint's ``record`` with this run's layout, training behaviour and tokenizer."""
    config = dataclasses.replace(
        record.config,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        generalized_tensor_parallel_size=args.generalized_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        calculate_per_token_loss=args.calculate_per_token_loss,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        init_seed=args.seed,
        params_dtype=torch.float32,  # re-derived from bf16 / fp16
        **{field: getattr(args, dest) for dest, field in BEHAVIOUR_ARGS.items()},
    )
    return record.replace(config=config, tokenizer=tokenizer)
