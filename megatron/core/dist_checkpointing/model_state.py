"""A module's sharded state dict, built from its parameters' sharding attributes alone.

Every parallel layer tags its parameters (``tensor_model_parallel``, ``partition_dim``,
``partition_sizes``, ``gtp_sharded``, ``gtp_rows``, ``global_shape``, ``shared_embedding``; see
``megatron.core.tensor_parallel.sharding``). :func:`describe_tensor` turns those attributes into
the checkpoint pieces of a parameter-shaped tensor (the parameter itself, or its optimizer
state), following DESIGN.md section 6:

* offsets: TP on ``partition_dim`` (packed parts split separately, stored one global tensor per
  part), then GTP on dim 0 of the TP-local rows (uneven when G does not divide; the padding is
  stripped, so the saved global shape is the true one);
* rows beyond a parameter's true row count (a vocabulary padded for TP) are not saved; on
  load they come back as zeros;
* replica id: ``(tp rank unless TP-sharded, gtp rank unless GTP-sharded, dp_cp rank)``, plus
  the pipeline rank for a tied embedding copy, so only the first stage's copy is main.

Keys use global layer numbers: a ``ModuleList`` whose children carry distinct ``layer_number``
attributes (1-based) is keyed by ``layer_number - 1`` instead of the local index, so a layer
has the same key under every pipeline layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.metadata import read_metadata
from megatron.core.dist_checkpointing.sharding import gtp_row_range, packed_column_parallel_factory, replica_id
from megatron.core.process_groups import ProcessGroupCollection

ModelPieces = dict  # local parameter name -> ShardedTensor | ShardedTensorFactory


@dataclass(frozen=True)
class CheckpointParam:
    """One parameter (or persistent buffer) as the checkpoint sees it: its module-local
    ``name``, its layout-free checkpoint ``key`` and, for a padded vocabulary, the true number
    of rows to keep."""

    name: str
    key: str
    param: torch.Tensor
    true_rows: int | None = None


def _global_names(module: nn.Module, prefix: str = "") -> dict[str, str]:
    """Module-local name of every submodule -> its name with global layer indices."""
    names = {"": prefix.rstrip(".")}

    def walk(mod: nn.Module, local: str, global_: str) -> None:
        children = list(mod.named_children())
        numbers = [getattr(child, "layer_number", None) for _, child in children]
        renumber = (
            isinstance(mod, nn.ModuleList)
            and children
            and all(isinstance(n, int) for n in numbers)
            and len(set(numbers)) == len(numbers)
        )
        for (child_name, child), number in zip(children, numbers, strict=True):
            child_global = str(number - 1) if renumber else child_name
            child_local_path = f"{local}.{child_name}" if local else child_name
            child_global_path = f"{global_}.{child_global}" if global_ else child_global
            names[child_local_path] = child_global_path
            walk(child, child_local_path, child_global_path)

    walk(module, "", prefix.rstrip("."))
    return names


def checkpoint_params(
    module: nn.Module, prefix: str = "", true_rows: dict[int, int] | None = None
) -> list[CheckpointParam]:
    """Every parameter of ``module`` (each once, tied ones under their first name) with its
    checkpoint key. ``true_rows`` maps ``id(param)`` to its unpadded global row count."""
    true_rows = true_rows or {}
    modules = _global_names(module, prefix)
    out = []
    for name, param in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        base = modules[owner]
        out.append(CheckpointParam(name, f"{base}.{leaf}" if base else leaf, param, true_rows.get(id(param))))
    return out


def checkpoint_buffers(module: nn.Module, prefix: str = "") -> list[CheckpointParam]:
    """Every persistent buffer of ``module`` (model state a step changes outside the optimizer,
    such as an MoE router's expert bias) with its checkpoint key, named like the parameters."""
    modules = _global_names(module, prefix)
    out = []
    for owner, submodule in module.named_modules():
        base = modules[owner]
        for leaf, buffer in submodule.named_buffers(recurse=False):
            if leaf not in submodule._non_persistent_buffers_set:  # what state_dict() holds
                name = f"{owner}.{leaf}" if owner else leaf
                out.append(CheckpointParam(name, f"{base}.{leaf}" if base else leaf, buffer))
    return out


def model_checkpoint_tensors(
    module: nn.Module, prefix: str = "", true_rows: dict[int, int] | None = None
) -> list[CheckpointParam]:
    """What a checkpoint holds of ``module``'s own state: its parameters, then its persistent buffers."""
    return checkpoint_params(module, prefix, true_rows) + checkpoint_buffers(module, prefix)


def _attr(param: torch.Tensor, name: str, default):
    return getattr(param, name, default)


def _expert_box(param: torch.Tensor, pg: ProcessGroupCollection) -> tuple[list[int], list[int], list[int]]:
    """(global shape, offset, size) of an expert parameter: dim 0 is the global expert index
    (EP rank r holds experts ``r * local .. (r + 1) * local``), and a ``tensor_model_parallel``
    one is split over ``expt_tp`` along its ``partition_dim``. Keys do not depend on EP/ETP,
    so a checkpoint loads at any other expert layout."""
    local = [int(s) for s in param.shape]
    global_shape, offset, size = list(local), [0] * len(local), list(local)
    global_shape[0] = local[0] * pg.size("ep")
    offset[0] = local[0] * pg.rank("ep")
    if _attr(param, "tensor_model_parallel", False):
        dim = _attr(param, "partition_dim", -1)
        etp_size, etp_rank = pg.size("expt_tp"), pg.rank("expt_tp")
        global_shape[dim] = local[dim] * etp_size
        offset[dim] = local[dim] * etp_rank
    return global_shape, offset, size


def _local_box(param: torch.Tensor, pg: ProcessGroupCollection) -> tuple[list[int], list[int], list[int]]:
    """(global shape, offset, size) of this rank's unpadded piece of ``param``."""
    if _attr(param, "is_expert", False):
        return _expert_box(param, pg)
    global_shape = [int(s) for s in _attr(param, "global_shape", tuple(param.shape))]
    offset, size = [0] * len(global_shape), list(global_shape)
    dim = _attr(param, "partition_dim", -1) if _attr(param, "tensor_model_parallel", False) else -1
    tp_size, tp_rank = pg.size("tp"), pg.rank("tp")
    if dim > 0:
        if global_shape[dim] % tp_size:
            raise CheckpointingError(
                f"dimension {dim} of global shape {tuple(global_shape)} is not divisible by the tensor-parallel "
                f"size {tp_size}"
            )
        size[dim] = global_shape[dim] // tp_size
        offset[dim] = tp_rank * size[dim]
    if dim == 0 or _attr(param, "gtp_sharded", False):
        gtp = _attr(param, "gtp_sharded", False)
        offset[0], size[0] = gtp_row_range(
            global_shape[0],
            tp_rank if dim == 0 else 0,
            tp_size if dim == 0 else 1,
            pg.rank("gtp") if gtp else 0,
            pg.size("gtp") if gtp else 1,
        )
    return global_shape, offset, size


def _padded_to(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` rows (the padding a load gives back)."""
    missing = rows - tensor.shape[0]
    if missing <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((missing,) + tuple(tensor.shape[1:]))])


def param_replica_id(param: torch.Tensor, pg: ProcessGroupCollection) -> tuple[int, ...]:
    """Section-6 replica id of ``param``'s piece on this rank; an expert piece's copies are
    its ``expt_dp`` replicas (and ``expt_tp`` peers when it is not split over them)."""
    if _attr(param, "is_expert", False):
        tp_sharded = bool(_attr(param, "tensor_model_parallel", False))
        return (0 if tp_sharded else pg.rank("expt_tp"), pg.rank("gtp"), dist.get_rank(pg.expert_dp_group()))
    rid = replica_id(
        pg,
        tp_sharded=bool(_attr(param, "tensor_model_parallel", False)),
        gtp_sharded=bool(_attr(param, "gtp_sharded", False)),
    )
    if _attr(param, "shared_embedding", False):
        rid += (pg.rank("pp"),)  # the copy on a later pipeline stage is never the main one
    return rid


def _gated_expert_factory(key, tensor, dim, global_shape, offset, rid) -> ShardedTensorFactory:
    """An ETP shard ``[gate_r; up_r]`` of a gated expert weight (global ``[gate; up]`` along
    ``dim``) as its two pieces of the one global tensor ``key``, so any ETP loads it."""
    half, global_half = tensor.shape[dim] // 2, global_shape[dim] // 2
    gate_offset = offset[dim] // 2  # the box spans [gate_r; up_r] as if contiguous

    def build(key_, data, replica):
        pieces = {}
        for name, (start, part) in zip(("gate", "up"), enumerate(data.split(half, dim)), strict=True):
            at = list(offset)
            at[dim] = start * global_half + gate_offset
            pieces[name] = ShardedTensor(
                key_, part, part.dtype, tuple(part.shape), global_shape, at, None, replica_id=replica
            )
        return pieces

    def merge(loaded):
        return torch.cat([loaded["gate"], loaded["up"]], dim)

    return ShardedTensorFactory(key, tensor, build, merge, replica_id=rid)


def describe_tensor(
    key: str, tensor: torch.Tensor, spec: CheckpointParam, pg: ProcessGroupCollection
) -> ShardedTensor | ShardedTensorFactory:
    """The checkpoint pieces of ``tensor``, laid out like ``spec.param`` (same local shape),
    under global key ``key``. Loading gives back a tensor of ``tensor``'s shape (padding rows
    zero)."""
    param = spec.param
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointingError(
            f"{key}: tensor of shape {tuple(tensor.shape)} is not shaped like its parameter {tuple(param.shape)}"
        )
    global_shape, offset, size = _local_box(param, pg)
    rid = param_replica_id(param, pg)
    if _attr(param, "is_expert", False) and _attr(param, "expert_gated", False):
        return _gated_expert_factory(key, tensor, param.partition_dim, global_shape, offset, rid)
    local_rows = tensor.shape[0] if tensor.dim() else 0
    parts = _attr(param, "partition_sizes", None)
    if parts and _attr(param, "tensor_model_parallel", False):
        if param.partition_dim != 0 or spec.true_rows is not None:
            raise CheckpointingError(f"{key}: packed parts are supported on dim 0 without row padding only")
        gtp = _attr(param, "gtp_sharded", False)
        inner = packed_column_parallel_factory(
            key,
            tensor[: size[0]],
            [f"part{i}" for i in range(len(parts))],
            parts,
            tp_rank=pg.rank("tp"),
            tp_size=pg.size("tp"),
            gtp_rank=pg.rank("gtp") if gtp else 0,
            gtp_size=pg.size("gtp") if gtp else 1,
            replica_id=rid,
        )
        return ShardedTensorFactory(
            key,
            inner.data,
            inner.build_fn,
            lambda loaded: _padded_to(inner.merge_fn(loaded), local_rows),
            replica_id=rid,
        )
    if spec.true_rows is not None:
        global_shape[0] = spec.true_rows
        size[0] = max(0, min(size[0], spec.true_rows - offset[0]))
        offset[0] = min(offset[0], spec.true_rows)
    kept = size[0] if size else None
    if kept == local_rows or not size:
        return ShardedTensor(key, tensor, tensor.dtype, size, global_shape, offset, None, replica_id=rid)

    def build(key_, data, replica):
        if not kept:
            return {}
        return {"rows": ShardedTensor(key_, data, data.dtype, size, global_shape, offset, None, replica_id=replica)}

    def merge(loaded):
        rows = loaded.get("rows", tensor.new_empty((0,) + tuple(tensor.shape[1:])))
        return _padded_to(rows, local_rows)

    return ShardedTensorFactory(key, tensor[:kept], build, merge, replica_id=rid)


def vocab_rows(model: nn.Module) -> dict[int, int]:
    """``id(param) -> vocab_size`` for the vocabulary-padded weights of a language model
    (input embedding and output layer), read from its ``vocab_size`` / ``padded_vocab_size``."""
    vocab, padded = getattr(model, "vocab_size", None), getattr(model, "padded_vocab_size", None)
    if vocab is None or padded == vocab:
        return {}
    rows = {}
    for module in (getattr(model, "embedding", None), getattr(model, "output_layer", None)):
        for param in module.parameters() if module is not None else ():
            if tuple(_attr(param, "global_shape", param.shape))[:1] == (padded,):
                rows[id(param)] = vocab
    return rows


def model_sharded_state_dict(
    module: nn.Module, pg: ProcessGroupCollection, prefix: str = "", true_rows: dict[int, int] | None = None
) -> ModelPieces:
    """``{local name: pieces}`` of every parameter and persistent buffer of ``module``; pass
    the result of ``dist_checkpointing.load`` to :func:`load_model_pieces`."""
    return {
        spec.name: describe_tensor(spec.key, spec.param.detach(), spec, pg)
        for spec in model_checkpoint_tensors(module, prefix, true_rows)
    }


def stored_pieces(module: nn.Module, pieces: ModelPieces, checkpoint_dir: str) -> ModelPieces:
    """``pieces`` (of :func:`model_sharded_state_dict`) less the buffers ``checkpoint_dir``
    does not hold (it was saved before buffers were), so that it still loads; those keep
    their values."""
    stored = read_metadata(checkpoint_dir).tensors
    buffers = {spec.name for spec in checkpoint_buffers(module)}
    return {name: piece for name, piece in pieces.items() if name not in buffers or piece.key in stored}


@torch.no_grad()
def load_model_pieces(module: nn.Module, loaded: dict) -> None:
    """Copy loaded tensors (keyed by local name) into ``module``'s parameters and persistent
    buffers in place (DDP buffers that view the parameters stay valid). Every parameter must be
    present; a buffer absent from ``loaded`` (see :func:`stored_pieces`) keeps its value."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise CheckpointingError(f"loaded state lacks {len(missing)} parameters, e.g. {missing[:4]}")
    for name, param in params.items():
        param.data.copy_(loaded[name])
    for spec in checkpoint_buffers(module):
        if spec.name in loaded:
            spec.param.copy_(loaded[spec.name])
