"""Token permutation and the token dispatchers that move routed tokens to their experts.

A routing decision is ``expert_of_slot [T, k]`` (global expert ids, ``num_experts`` for a slot
dropped by the capacity factor) and ``probs [T, k]``; each of the ``T * k`` slots goes to one expert.
:func:`permute` sorts the slots by expert with one
stable sort (no loop over tokens); :func:`unpermute` puts each expert output back in its slot and
sums a token's ``k`` slots in slot order, so a token's output never depends on the other tokens
of the batch.

Dispatchers (``config.moe_token_dispatcher_type``) over the ``ep`` group of the collection:

- ``allgather``: every EP rank gathers all tokens and decisions, runs its local experts on the
  slots routed to them, and a reduce-scatter sums the partial outputs back to the tokens' ranks;
- ``alltoall``: each rank sends only the slots of the other ranks' experts and gets their outputs
  back (two all-to-alls each way).

With expert tensor parallelism (an ``expt_tp`` group of size > 1, each rank holding an ffn shard
of its experts) the tokens a rank got for its experts are all-gathered over ``expt_tp``, every
peer computes its partial sum for all of them, and a reduce-scatter gives each its own rows
back summed (Megatron's alltoall dispatcher). The tokens of ``expt_tp`` peers must be distinct:
the MoE layer splits tokens replicated over TP first.

At EP 1 and ETP 1 both are the local permutation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.collectives import all_gather_along_dim
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def permute(hidden: torch.Tensor, expert_of_slot: torch.Tensor, num_experts: int):
    """Rows of ``hidden [T, h]`` for each slot of ``expert_of_slot [T, k]`` (ids in
    ``[0, num_experts]``; ``num_experts`` marks a slot to skip), sorted by expert.

    Returns ``(permuted [n, h], order [n] slot ids of the rows, tokens_per_expert [num_experts])``.
    """
    k = expert_of_slot.shape[-1]
    flat = expert_of_slot.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    tokens_per_expert = counts[:num_experts]
    order = torch.argsort(flat, stable=True)[: flat.numel() - int(counts[num_experts])]
    return hidden.index_select(0, order // k), order, tokens_per_expert


def unpermute(expert_out: torch.Tensor, order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute`: ``sum_j probs[t, j] * out(slot t, j)`` -> ``[T, h]`` (skipped
    slots contribute zero); the weighting is in fp32, the sum over a token's slots in slot order."""
    num_tokens, k = probs.shape
    slots = expert_out.new_zeros(num_tokens * k, expert_out.shape[-1], dtype=torch.float32)
    slots = slots.index_copy(0, order, expert_out.float())
    weighted = slots.view(num_tokens, k, -1) * probs.unsqueeze(-1)
    return weighted.sum(1).to(expert_out.dtype)


def _row_counts(rows: int, group, device) -> list[int]:
    """Every rank's row count in ``group``, in group-rank order."""
    return all_gather_along_dim(torch.tensor([rows], device=device), 0, group).tolist()


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (``sizes[r]`` rows on rank ``r``) along dim 0."""
    world = len(sizes)
    out = x.new_empty(sum(sizes), *x.shape[1:])
    copies = x.contiguous().repeat((world,) + (1,) * (x.dim() - 1))
    dist.all_to_all_single(out, copies, sizes, [x.shape[0]] * world, group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum ``x`` (``sum(sizes)`` rows, the same layout on every rank) over ``group`` and keep this
    rank's ``sizes[rank]`` rows; the sum runs in group-rank order."""
    world, mine = len(sizes), sizes[dist.get_rank(group)]
    pieces = x.new_empty(world * mine, *x.shape[1:])
    dist.all_to_all_single(pieces, x.contiguous(), [mine] * world, sizes, group=group)
    return pieces.view(world, mine, *x.shape[1:]).sum(0)


def _own_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    rank = dist.get_rank(group)
    return x.narrow(0, sum(sizes[:rank]), sizes[rank])


class _RowsOp(torch.autograd.Function):
    """``forward(x, sizes, group)`` over rows of uneven counts, with ``backward`` its adjoint."""

    @staticmethod
    def forward(ctx, x, sizes, group, forward, backward):
        ctx.sizes, ctx.group, ctx.adjoint = sizes, group, backward
        return forward(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, ctx.sizes, ctx.group), None, None, None, None


def _gather_rows(x, sizes, group):
    """All-gather rows; backward: reduce-scatter (peers hold partial gradients)."""
    return _RowsOp.apply(x, sizes, group, _all_gather_rows, _reduce_scatter_rows)


def _scatter_summed_rows(x, sizes, group):
    """Reduce-scatter rows; backward: all-gather."""
    return _RowsOp.apply(x, sizes, group, _reduce_scatter_rows, _all_gather_rows)


def _split_rows(x, sizes, group):
    """This rank's rows of a tensor replicated over ``group``; backward: all-gather."""
    return _RowsOp.apply(x, sizes, group, _own_rows, _all_gather_rows)


def _gather_replicated_rows(x, sizes, group):
    """All-gather rows into a tensor replicated over ``group``; backward: this rank's rows."""
    return _RowsOp.apply(x, sizes, group, _all_gather_rows, _own_rows)


def split_sizes(rows: int, world: int) -> list[int]:
    """``rows`` split over ``world`` ranks as evenly as possible, the first ranks one more."""
    return [rows // world + (rank < rows % world) for rank in range(world)]


def split_replicated_tokens(tensors, group):
    """This rank's share of token rows replicated over ``group`` (TP without sequence parallel), so
    that the expert domain sees every token once: ``(shares, sizes)``; gradients of the shares
    are all-gathered back. :func:`gather_replicated_tokens` undoes it."""
    sizes = split_sizes(tensors[0].shape[0], dist.get_world_size(group))
    shares = [_split_rows(t, sizes, group) if t.is_floating_point() else _own_rows(t, sizes, group) for t in tensors]
    return shares, sizes


def gather_replicated_tokens(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Inverse of :func:`split_replicated_tokens`: every rank's share, replicated again."""
    return _gather_replicated_rows(x, sizes, group)


def _regroup_by_local_expert(counts: torch.Tensor) -> torch.Tensor:
    """Row order that sorts rows laid out as ``counts [sources, num_local]`` blocks (source-major)
    by local expert, stable within each expert."""
    num_local = counts.shape[-1]
    local_expert = torch.repeat_interleave(
        torch.arange(num_local, device=counts.device).repeat(counts.shape[0]), counts.reshape(-1)
    )
    return torch.argsort(local_expert, stable=True)


def _run_sharded_experts(experts, tokens, counts, etp_group):
    """``experts`` on ``tokens`` (rows in ``counts [sources, num_local]`` blocks), with the rows of
    every ``expt_tp`` peer gathered first and the partial sums reduced back to their rank."""
    if etp_group is not None:
        sizes = _row_counts(tokens.shape[0], etp_group, tokens.device)
        tokens = _gather_rows(tokens, sizes, etp_group)
        counts = all_gather_along_dim(counts.contiguous(), 0, etp_group)
    regroup = _regroup_by_local_expert(counts)
    out = experts(tokens.index_select(0, regroup), counts.sum(0))
    out = out.index_select(0, torch.argsort(regroup))
    if etp_group is not None:
        out = _scatter_summed_rows(out, sizes, etp_group)
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with explicit split sizes; the backward swaps them."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


def _local_slots(expert_of_slot, offset, num_local):
    """Expert ids relative to this rank's experts, ``num_local`` for slots of other ranks or dropped."""
    local = expert_of_slot - offset
    return local.masked_fill((local < 0) | (local >= num_local), num_local)


class AllGatherTokenDispatcher:
    """Gather tokens over ``ep`` (then ``expt_tp``), run the local experts, reduce-scatter the
    outputs back."""

    def __init__(self, num_local_experts: int, local_expert_offset: int, ep_group, ep_size: int, etp_group=None):
        self.num_local_experts, self.local_expert_offset = num_local_experts, local_expert_offset
        self.ep_group, self.ep_size, self.etp_group = ep_group, ep_size, etp_group

    def __call__(self, experts, hidden, probs, expert_of_slot):
        if self.ep_size > 1:
            hidden = gather_from_sequence_parallel_region(hidden, self.ep_group)
            probs = gather_from_sequence_parallel_region(probs, self.ep_group)
            expert_of_slot = all_gather_along_dim(expert_of_slot, 0, self.ep_group)
        if self.etp_group is not None:
            sizes = _row_counts(hidden.shape[0], self.etp_group, hidden.device)
            hidden = _gather_rows(hidden, sizes, self.etp_group)
            probs = _gather_rows(probs, sizes, self.etp_group)
            expert_of_slot = _all_gather_rows(expert_of_slot, sizes, self.etp_group)
        local = _local_slots(expert_of_slot, self.local_expert_offset, self.num_local_experts)
        permuted, order, tokens_per_expert = permute(hidden, local, self.num_local_experts)
        out = unpermute(experts(permuted, tokens_per_expert), order, probs)
        if self.etp_group is not None:
            out = _scatter_summed_rows(out, sizes, self.etp_group)
        if self.ep_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group)
        return out


class AllToAllTokenDispatcher:
    """Send each rank only the slots routed to its experts (all-gathered over ``expt_tp``), and
    get their outputs back."""

    def __init__(self, num_local_experts: int, local_expert_offset: int, ep_group, ep_size: int, etp_group=None):
        self.num_local_experts, self.local_expert_offset = num_local_experts, local_expert_offset
        self.ep_group, self.ep_size, self.etp_group = ep_group, ep_size, etp_group

    def __call__(self, experts, hidden, probs, expert_of_slot):
        num_experts = self.num_local_experts * self.ep_size
        # Sorted by global expert = sorted by destination rank, then by its local expert.
        permuted, order, tokens_per_global = permute(hidden, expert_of_slot, num_experts)
        if self.ep_size == 1 and self.etp_group is None:
            return unpermute(experts(permuted, tokens_per_global), order, probs)
        counts = tokens_per_global.view(self.ep_size, self.num_local_experts)
        if self.ep_size == 1:
            return unpermute(_run_sharded_experts(experts, permuted, counts, self.etp_group), order, probs)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # [source rank, local expert]
        input_splits = counts.sum(1).tolist()
        output_splits = received.sum(1).tolist()
        tokens = _AllToAll.apply(permuted, output_splits, input_splits, self.ep_group)
        # Rows arrive grouped by source rank; the experts regroup them by local expert.
        out = _run_sharded_experts(experts, tokens, received, self.etp_group)
        out = _AllToAll.apply(out, input_splits, output_splits, self.ep_group)
        return unpermute(out, order, probs)


DISPATCHERS = {"allgather": AllGatherTokenDispatcher, "alltoall": AllToAllTokenDispatcher}
