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

At EP 1 both are the local permutation.
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
    """Gather tokens over ``ep``, run the local experts, reduce-scatter the outputs back."""

    def __init__(self, num_local_experts: int, local_expert_offset: int, ep_group, ep_size: int):
        self.num_local_experts, self.local_expert_offset = num_local_experts, local_expert_offset
        self.ep_group, self.ep_size = ep_group, ep_size

    def __call__(self, experts, hidden, probs, expert_of_slot):
        if self.ep_size > 1:
            hidden = gather_from_sequence_parallel_region(hidden, self.ep_group)
            probs = gather_from_sequence_parallel_region(probs, self.ep_group)
            expert_of_slot = all_gather_along_dim(expert_of_slot, 0, self.ep_group)
        local = _local_slots(expert_of_slot, self.local_expert_offset, self.num_local_experts)
        permuted, order, tokens_per_expert = permute(hidden, local, self.num_local_experts)
        out = unpermute(experts(permuted, tokens_per_expert), order, probs)
        if self.ep_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group)
        return out


class AllToAllTokenDispatcher:
    """Send each rank only the slots routed to its experts, and get their outputs back."""

    def __init__(self, num_local_experts: int, local_expert_offset: int, ep_group, ep_size: int):
        self.num_local_experts, self.local_expert_offset = num_local_experts, local_expert_offset
        self.ep_group, self.ep_size = ep_group, ep_size

    def __call__(self, experts, hidden, probs, expert_of_slot):
        num_experts = self.num_local_experts * self.ep_size
        if self.ep_size == 1:
            permuted, order, tokens_per_expert = permute(hidden, expert_of_slot, num_experts)
            return unpermute(experts(permuted, tokens_per_expert), order, probs)
        # Sorted by global expert = sorted by destination rank, then by its local expert.
        permuted, order, tokens_per_global = permute(hidden, expert_of_slot, num_experts)
        counts = tokens_per_global.view(self.ep_size, self.num_local_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # [source rank, local expert]
        input_splits = counts.sum(1).tolist()
        output_splits = received.sum(1).tolist()
        tokens = _AllToAll.apply(permuted, output_splits, input_splits, self.ep_group)
        # Rows arrive grouped by source rank; regroup them by local expert (stable within each).
        local_expert = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=tokens.device).repeat(self.ep_size), received.reshape(-1)
        )
        regroup = torch.argsort(local_expert, stable=True)
        out = experts(tokens.index_select(0, regroup), received.sum(0))
        out = out.index_select(0, torch.argsort(regroup))
        out = _AllToAll.apply(out, input_splits, output_splits, self.ep_group)
        return unpermute(out, order, probs)


DISPATCHERS = {"allgather": AllGatherTokenDispatcher, "alltoall": AllToAllTokenDispatcher}
