"""Mixed-precision, distributed and chained optimizers, built by :func:`get_megatron_optimizer`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.muon import Muon, MuonMatrix
from megatron.core.optimizer.optimizer import MasterParam, MegatronOptimizer, step_optimizers
from megatron.core.optimizer.optimizer_config import OptimizerConfig, OptimizerConfigError
from megatron.core.parallel_state import resolve_pg_collection


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Biases and 1-D parameters (norm weights, Mamba scalars) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def build_grad_scaler(config: OptimizerConfig):
    """A constant scaler when ``loss_scale`` is set, a dynamic one for fp16, else None."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def is_embedding_or_output(name: str) -> bool:
    """The word embeddings and the output layer's weight (Megatron's ``is_embedding_or_output_parameter``)."""
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")


def get_param_groups(
    model_chunks: list[torch.nn.Module],
    no_weight_decay_cond: Callable = default_no_weight_decay,
    decoupled_lr: bool = False,
) -> list[dict]:
    """Trainable parameters (each once) split into a decayed (``wd_mult`` 1) and a
    non-decayed (``wd_mult`` 0) group, and with ``decoupled_lr`` the embeddings and output
    layer into groups of their own (``is_decoupled_lr``, scheduled from ``--decoupled-lr``);
    empty groups are left out."""
    groups: dict[tuple[bool, bool], list] = {}
    seen = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            key = (no_weight_decay_cond(name, param), decoupled_lr and is_embedding_or_output(name))
            groups.setdefault(key, []).append(param)
    return [
        {"params": groups[key], "wd_mult": 0.0 if key[0] else 1.0, "lr_mult": 1.0, "is_decoupled_lr": key[1]}
        for key in sorted(groups)
    ]


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks,
    pg_collection=None,
    *,
    no_weight_decay_cond: Callable = default_no_weight_decay,
):
    """Build the optimizer for ``model_chunks`` (one module or a list, e.g. virtual-pipeline
    chunks). With ``config.use_distributed_optimizer`` every chunk must be a
    :class:`DistributedDataParallel` built with ``use_distributed_optimizer=True`` (and
    without it, none may be): the two must agree on how gradients are reduced."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    pg = resolve_pg_collection(pg_collection)
    for index, chunk in enumerate(chunks):
        ddp_sharded = isinstance(chunk, DistributedDataParallel) and chunk.ddp_config.use_distributed_optimizer
        if ddp_sharded != config.use_distributed_optimizer:
            raise OptimizerConfigError(
                f"model chunk {index}: OptimizerConfig.use_distributed_optimizer is "
                f"{config.use_distributed_optimizer} but the chunk is "
                + ("a DistributedDataParallel with" if ddp_sharded else "not a DistributedDataParallel with")
                + " ddp_config.use_distributed_optimizer=True; the two settings must match"
            )
    groups = get_param_groups(chunks, no_weight_decay_cond, config.decoupled_lr is not None)
    scaler = build_grad_scaler(config)

    def build(member_config, member_groups, matrices=None):
        if config.use_distributed_optimizer:
            buffers = [buffer for chunk in chunks for buffer in chunk.param_and_grad_buffers]
            return DistributedOptimizer(member_config, member_groups, pg, scaler, buffers, matrices)
        return MegatronOptimizer(member_config, member_groups, pg, scaler, matrices)

    if config.optimizer != "muon":
        return build(config, groups)
    matrices = muon_matrices(chunks, pg, config.muon_split_qkv)
    muon_groups = [{**g, "params": [p for p in g["params"] if id(p) in matrices]} for g in groups]
    adam_groups = [{**g, "params": [p for p in g["params"] if id(p) not in matrices]} for g in groups]
    members = [build(config, [g for g in muon_groups if g["params"]], matrices)]
    if any(g["params"] for g in adam_groups):
        members.append(build(dataclasses.replace(config, optimizer="adam"), [g for g in adam_groups if g["params"]]))
    for member in members[:-1]:  # the last member's gather brings every member's shards (shared buffers)
        if isinstance(member, DistributedOptimizer):
            member.gathers_params = False
    return ChainedOptimizer(members)


def muon_matrices(chunks: list[torch.nn.Module], pg, split_qkv: bool) -> dict:
    """``{id(param): MuonMatrix}`` of the weights Muon steps (Megatron's choice): every 2-D
    weight but the word embeddings and the output layer, and each expert of the grouped expert
    weights; the QKV weight split into Q, K and V with ``split_qkv``. Generalized tensor
    parallelism is refused (its shards would have to be gathered too)."""
    matrices = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            expert = getattr(param, "is_expert", False)
            if id(param) in matrices or not param.requires_grad or param.dim() != (3 if expert else 2):
                continue
            if is_embedding_or_output(name):
                continue
            if getattr(param, "gtp_sharded", False):
                raise OptimizerConfigError(
                    "--optimizer muon does not support generalized tensor parallelism (weights sharded over GTP); "
                    "use --tensor-model-parallel-size or --use-distributed-optimizer"
                )
            sharded = getattr(param, "tensor_model_parallel", False)
            group = (pg.expt_tp if pg.has("expt_tp") else pg.tp) if expert else pg.tp
            split = None
            if split_qkv and name.endswith("linear_qkv.weight") and getattr(param, "partition_sizes", None):
                width = dist.get_world_size(group) if sharded else 1
                split = [size // width for size in param.partition_sizes]
            matrices[id(param)] = MuonMatrix(
                param, split, group if sharded else None, getattr(param, "partition_dim", None)
            )
    return matrices


__all__ = [
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "MasterParam",
    "MegatronOptimizer",
    "Muon",
    "MuonMatrix",
    "OptimizerConfig",
    "OptimizerConfigError",
    "build_grad_scaler",
    "default_no_weight_decay",
    "get_megatron_optimizer",
    "get_param_groups",
    "muon_matrices",
    "step_optimizers",
]
