"""Generalized tensor parallelism (GTP): a second sharding of a TP-local weight on dim 0.

A weight with ``rows`` TP-local rows is padded to ``G * ceil(rows / G)`` rows and peer ``r`` of
the ``gtp`` group holds rows ``[r * ceil(rows / G), (r + 1) * ceil(rows / G))`` (zero padding on
the last peer). For compute the weight is all-gathered and the padding stripped, in forward and
again in backward (the gathered weight is never saved for backward); the weight gradient is
padded, reduce-scattered over ``gtp`` and scaled by ``grad_scale`` (1/G for mean losses).

``COLLECTIVE_COUNTS`` counts the GTP all-gathers and reduce-scatters this process ran, so tests
can prove the weight really is sharded and re-materialized.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.collectives import all_gather_along_dim, reduce_scatter_along_dim0

COLLECTIVE_COUNTS: dict[str, int] = {"all_gather": 0, "reduce_scatter": 0}


def reset_collective_counts() -> None:
    """Zero :data:`COLLECTIVE_COUNTS`."""
    for name in COLLECTIVE_COUNTS:
        COLLECTIVE_COUNTS[name] = 0


def shard_rows_per_peer(rows: int, gtp_size: int) -> int:
    """Rows each GTP peer holds (``ceil(rows / gtp_size)``; the last peer's tail is padding)."""
    return -(-rows // gtp_size)


def padded_rows(rows: int, gtp_size: int) -> int:
    """``rows`` rounded up to a multiple of ``gtp_size``."""
    return shard_rows_per_peer(rows, gtp_size) * gtp_size


def shard_offset(rows: int, gtp_size: int, gtp_rank: int) -> tuple[int, int]:
    """``(first_row, num_true_rows)`` of peer ``gtp_rank``'s shard in the unpadded TP-local weight."""
    per_peer = shard_rows_per_peer(rows, gtp_size)
    first = min(gtp_rank * per_peer, rows)
    return first, max(0, min(per_peer, rows - first))


def shard_weight(tp_local: torch.Tensor, gtp_size: int, gtp_rank: int) -> torch.Tensor:
    """Peer ``gtp_rank``'s rows of ``tp_local`` (dim 0), zero padded to the common shard height."""
    rows = tp_local.shape[0]
    pad = padded_rows(rows, gtp_size) - rows
    if pad:
        tp_local = torch.cat([tp_local, tp_local.new_zeros((pad,) + tuple(tp_local.shape[1:]))], dim=0)
    per_peer = shard_rows_per_peer(rows, gtp_size)
    return tp_local[gtp_rank * per_peer : (gtp_rank + 1) * per_peer].clone()


def gather_weight(shard: torch.Tensor, group, rows: int) -> torch.Tensor:
    """All-gather the peers' shards on dim 0 and strip the padding: the TP-local weight."""
    COLLECTIVE_COUNTS["all_gather"] += 1
    return all_gather_along_dim(shard, 0, group)[:rows]


def reduce_scatter_grad(grad: torch.Tensor, group, grad_scale: float) -> torch.Tensor:
    """Pad the full TP-local weight gradient, reduce-scatter it over ``group`` and scale it."""
    COLLECTIVE_COUNTS["reduce_scatter"] += 1
    rows = grad.shape[0]
    pad = padded_rows(rows, dist.get_world_size(group)) - rows
    if pad:
        grad = torch.cat([grad, grad.new_zeros((pad,) + tuple(grad.shape[1:]))], dim=0)
    shard_grad = reduce_scatter_along_dim0(grad, group)
    return shard_grad * grad_scale if grad_scale != 1.0 else shard_grad


def grad_scale_for(calculate_per_token_loss: bool, gtp_size: int) -> float:
    """1/G for mean losses (the peers' gradients are averaged), 1 for per-token losses (summed)."""
    return 1.0 if calculate_per_token_loss else 1.0 / gtp_size


class _GatherGTPWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, rows, grad_scale):
        ctx.group, ctx.grad_scale = group, grad_scale
        return gather_weight(shard, group, rows)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_grad(grad, ctx.group, ctx.grad_scale), None, None, None


class _LinearWithGTPWeight(torch.autograd.Function):
    """``x @ W.T`` where W is gathered from GTP shards; backward re-gathers W instead of saving it.
    With a ``compute_dtype`` the GEMMs run on operands cast to it (gradients returned in the
    operands' dtypes)."""

    @staticmethod
    def forward(ctx, x, shard, group, rows, grad_scale, compute_dtype):
        ctx.save_for_backward(x, shard)
        ctx.group, ctx.rows, ctx.grad_scale, ctx.compute_dtype = group, rows, grad_scale, compute_dtype
        weight = gather_weight(shard, group, rows)
        if compute_dtype is not None:
            x, weight = x.to(compute_dtype), weight.to(compute_dtype)
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        dtype = ctx.compute_dtype
        grad_x = grad_shard = None
        if ctx.needs_input_grad[0]:
            weight = gather_weight(shard, ctx.group, ctx.rows)
            if dtype is None:
                grad_x = torch.matmul(grad_out, weight)
            else:
                grad_x = torch.matmul(grad_out.to(dtype), weight.to(dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_rows, rows = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            if dtype is None:
                grad_w = torch.matmul(grad_rows.t(), rows)
            else:
                grad_w = torch.matmul(grad_rows.to(dtype).t(), rows.to(dtype)).to(shard.dtype)
            grad_shard = reduce_scatter_grad(grad_w, ctx.group, ctx.grad_scale)
        return grad_x, grad_shard, None, None, None, None


def gather_gtp_weight(shard: torch.Tensor, group, rows: int, grad_scale: float) -> torch.Tensor:
    """Differentiable all-gather of a GTP-sharded weight (backward: scaled reduce-scatter).

    Use it when the consumer does not need the weight in its backward (an embedding lookup);
    linear layers use :func:`linear_with_gtp_weight`, which never keeps the gathered weight.
    """
    return _GatherGTPWeight.apply(shard, group, rows, grad_scale)


def linear_with_gtp_weight(
    x: torch.Tensor, shard: torch.Tensor, group, rows: int, grad_scale: float, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ W.T`` (no bias) with W the gathered GTP weight of ``rows`` true rows, computed in
    ``compute_dtype`` when given (e.g. fp32 from bf16 operands)."""
    return _LinearWithGTPWeight.apply(x, shard, group, rows, grad_scale, compute_dtype)
