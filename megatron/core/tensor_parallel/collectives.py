"""Plain (non-autograd) collectives on a dimension, with the fallbacks gloo needs.

Gloo implements neither ``reduce_scatter`` nor ``all_gather_into_tensor``; on gloo groups
these helpers use ``all_reduce`` + slice and list ``all_gather`` instead. Every other backend
gets the native collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import TensorParallelError


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``tensor`` over ``group`` (a new tensor; the input is left untouched)."""
    out = tensor.clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


def all_reduce_coalesced(tensors: list[torch.Tensor], group, scale: float = 1.0) -> None:
    """Sum ``tensors`` over ``group`` in place (one flat buffer per dtype), then multiply by ``scale``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype in sorted(by_dtype, key=str):
        same = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def all_gather_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's equally shaped ``tensor`` along ``dim`` in group-rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    if _is_gloo(group):
        pieces = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(pieces, tensor, group=group)
        return torch.cat(pieces, dim=dim)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0],) + tuple(moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and keep this rank's equal chunk of dim 0."""
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    if tensor.shape[0] % world:
        raise TensorParallelError(
            f"reduce-scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size ({world})"
        )
    rank = dist.get_rank(group)
    chunk = tensor.shape[0] // world
    if _is_gloo(group):
        total = all_reduce_sum(tensor.contiguous(), group)
        return total.narrow(0, rank * chunk, chunk).contiguous()
    out = torch.empty((chunk,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_tensor(out, tensor.contiguous(), group=group)
    return out
