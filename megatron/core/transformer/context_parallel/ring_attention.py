"""Causal attention over a sequence sharded across the CP group (load-balanced chunks, see
:mod:`sharding`), in two modes (``cp_comm_type``):

- ``p2p`` (ring attention): each rank's K/V travel around the ring with asynchronous
  send/recv, overlapped with the attention of the local queries against the block already
  here; partial results merge by log-sum-exp. The backward runs the ring again and dK/dV
  accumulators travel with the K/V, arriving back at their owner after a full turn.
- ``all_gather``: K/V are all-gathered (reduce-scattered in backward) and each rank attends
  its queries to the whole sequence with a position mask.

Causal masking per chunk pair (rank r holds chunks r and 2c-1-r; K/V of rank j arrive at step
(r - j) mod c): at step 0 the local block is causal; K/V of an earlier rank (j < r) are seen
in their first chunk only, by every local query; K/V of a later rank (j > r) are seen whole,
by the local late chunk only. Every rank thus computes 2c chunk pairs' worth of attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.context_parallel.block_attention import BlockAttention
from megatron.core.transformer.context_parallel.sharding import (
    ContextParallelConfigError,
    check_divisible,
    local_positions,
    natural_order_index,
)

KV_TAG, DKV_TAG = 71, 72


@dataclass(frozen=True)
class RingStep:
    """One step of a rank's ring: whose K/V are here, and which local query rows and key
    rows (slices of the two-chunk local sequence) attend to each other."""

    source: int  # CP rank that owns the K/V held at this step
    q_rows: slice
    kv_rows: slice
    causal: bool

    def chunk_pairs(self, chunk_length: int) -> float:
        """Attention work of the step in chunk pairs (a causal square block computes half its pairs:
        the pairs below the diagonal, and the diagonal ones half each)."""
        rows = (self.q_rows.stop - self.q_rows.start) // chunk_length
        cols = (self.kv_rows.stop - self.kv_rows.start) // chunk_length
        return rows * cols / 2 if self.causal else rows * cols


def ring_plan(cp_rank: int, cp_size: int, chunk_length: int) -> list[RingStep]:
    """The ``cp_size`` steps of ``cp_rank``'s ring (see the module doc)."""
    whole, early, late = slice(0, 2 * chunk_length), slice(0, chunk_length), slice(chunk_length, 2 * chunk_length)
    steps = []
    for step in range(cp_size):
        source = (cp_rank - step) % cp_size
        if step == 0:
            steps.append(RingStep(source, whole, whole, causal=True))
        elif source < cp_rank:
            steps.append(RingStep(source, whole, early, causal=False))
        else:
            steps.append(RingStep(source, late, whole, causal=False))
    return steps


class _Ring:
    """Asynchronous exchange with the ring neighbours of the CP group: send to the next rank,
    receive from the previous one."""

    def __init__(self, group: dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(group)
        self.group, self.rank, self.size = group, dist.get_rank(group), len(ranks)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def start(self, tensor: torch.Tensor, tag: int):
        """Post send of ``tensor`` and receive of an equal tensor; returns (works, received)."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(works) -> None:
        for work in works:
            work.wait()


def merge_block(out, lse, rows, block_out, block_lse):
    """Fold a block's (out, lse) for query ``rows`` into the running fp32 (out, lse)."""
    old_lse = lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old_lse - new_lse).unsqueeze(-1) + block_out.to(
        out.dtype
    ) * torch.exp(block_lse - new_lse).unsqueeze(-1)
    lse[..., rows] = new_lse


class RingAttention(torch.autograd.Function):
    """Ring attention of local ``q [b, heads, 2L, d]`` against the K/V ``[b, groups, 2L, d]``
    of every CP rank (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, kernel: BlockAttention, dropout_p: float = 0.0):
        ring = _Ring(group)
        # every block draws its own mask: from one seed of the caller's RNG, this rank and the step
        base_seed = int(torch.randint(0, 2**31, (1,), device=q.device).item()) if dropout_p > 0 else None
        chunk_length = q.shape[2] // 2
        plan = ring_plan(ring.rank, ring.size, chunk_length)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        auxes = []
        for i, step in enumerate(plan):
            pending = ring.start(kv, KV_TAG) if i < len(plan) - 1 else None
            dropout = None if base_seed is None else (dropout_p, (base_seed * 131 + ring.rank) * 1031 + i)
            block_out, block_lse, aux = kernel.forward(
                q[..., step.q_rows, :],
                kv[0][..., step.kv_rows, :],
                kv[1][..., step.kv_rows, :],
                step.causal,
                scale,
                dropout,
            )
            merge_block(out, lse, step.q_rows, block_out, block_lse)
            auxes.append(aux)
            if pending is not None:
                ring.finish(pending[0])
                kv = pending[1]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.kernel, ctx.auxes = group, scale, kernel, auxes
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, kernel, scale = _Ring(ctx.group), ctx.kernel, ctx.scale
        plan = ring_plan(ring.rank, ring.size, q.shape[2] // 2)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv, pending_dkv = None, None
        for i, step in enumerate(plan):
            pending_kv = ring.start(kv, KV_TAG) if i < len(plan) - 1 else None
            rows, cols = step.q_rows, step.kv_rows
            dq_block, dk_block, dv_block = kernel.backward(
                dout[..., rows, :],
                q[..., rows, :],
                kv[0][..., cols, :],
                kv[1][..., cols, :],
                out[..., rows, :],
                lse[..., rows],
                ctx.auxes[i],
                step.causal,
                scale,
            )
            dq[..., rows, :] += dq_block.to(acc)
            block_dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            block_dkv[0][..., cols, :] = dk_block.to(acc)
            block_dkv[1][..., cols, :] = dv_block.to(acc)
            if pending_dkv is None:
                dkv = block_dkv
            else:  # the accumulator of the K/V held here, from the ranks they visited before
                ring.finish(pending_dkv[0])
                dkv = pending_dkv[1] + block_dkv
            pending_dkv = ring.start(dkv, DKV_TAG)  # the last hop takes it home
            if pending_kv is not None:
                ring.finish(pending_kv[0])
                kv = pending_kv[1]
        ring.finish(pending_dkv[0])
        dk, dv = pending_dkv[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def all_gather_attention(q, k, v, group, scale, dropout_p: float = 0.0) -> torch.Tensor:
    """Local ``q [b, heads, 2L, d]`` against the all-gathered K/V, masked by global positions."""
    cp_rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    local_length = q.shape[2]
    chunk_length = check_divisible(local_length * cp_size, cp_size)
    # Gather along dim 0 ([2L, b, groups, d] pieces in rank order), then put chunks in natural order.
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)
    kv = gather_from_sequence_parallel_region(kv, group)
    kv = kv.index_select(0, natural_order_index(cp_size, chunk_length, q.device)).permute(1, 2, 3, 0, 4)
    q_pos = local_positions(local_length * cp_size, cp_rank, cp_size, q.device)
    k_pos = torch.arange(local_length * cp_size, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q, kv[0], kv[1], attn_mask=visible, dropout_p=dropout_p, scale=scale, enable_gqa=kv.shape[2] != q.shape[1]
    )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    comm_type: str,
    scale: float,
    kernel: BlockAttention,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this CP rank's ``q [b, heads, 2L, d]`` (chunks r and 2c-1-r) over the
    whole sequence's keys; ``k``/``v`` are this rank's ``[b, groups, 2L, d]``; attention
    probabilities dropped with ``dropout_p``. Returns [b, heads, 2L, d]."""
    check_divisible(q.shape[2] * dist.get_world_size(group), dist.get_world_size(group))
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, group, scale, kernel, dropout_p)
    if comm_type == "all_gather":
        return all_gather_attention(q, k, v, group, scale, dropout_p)
    raise ContextParallelConfigError(f"unknown cp_comm_type {comm_type!r}; accepted: p2p, all_gather")
