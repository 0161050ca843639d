"""Autograd collectives for tensor and sequence parallel regions.

Each function pairs a forward collective with its adjoint in backward (identity <-> all-reduce,
split <-> all-gather, reduce-scatter <-> all-gather). ``group`` is a torch ProcessGroup; with a
group of size 1 every function is the identity (the two called per linear layer return their
input without an autograd node).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.collectives import (
    all_gather_along_dim,
    all_reduce_sum,
    reduce_scatter_along_dim0,
)
from megatron.core.tensor_parallel.utils import split_along_dim


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    return split_along_dim(x, dim, world, dist.get_rank(group))


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else all_reduce_sum(x, group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of ``dim``; backward: all-gather ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather ``dim``; backward: this rank's chunk of ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Forward: all-gather dim 0; backward: reduce-scatter dim 0, or only split it when the
    consumer's gradient is already complete on every rank (``tensor_parallel_output_grad=False``)."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return all_gather_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return reduce_scatter_along_dim0(grad, ctx.group), None, None
        return _split(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, 0, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward identity; backward all-reduce (sum) of the gradient over ``group``."""
    return x if dist.get_world_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward all-reduce (sum) over ``group``; backward identity."""
    return x if dist.get_world_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: this rank's chunk of the last dim; backward: all-gather of the last dim."""
    return _ScatterToRegion.apply(x, group, x.dim() - 1)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather of the last dim; backward: this rank's chunk of the last dim."""
    return _GatherFromRegion.apply(x, group, x.dim() - 1)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: this rank's chunk of dim 0 (sequence); backward: all-gather of dim 0."""
    return _ScatterToRegion.apply(x, group, 0)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """Forward: all-gather of dim 0. Backward: reduce-scatter of dim 0 when the output feeds
    tensor-parallel compute (each rank holds a partial gradient), else a plain split."""
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: sum over ``group`` and keep this rank's chunk of dim 0; backward: all-gather dim 0."""
    return _ReduceScatterToSequenceRegion.apply(x, group)
