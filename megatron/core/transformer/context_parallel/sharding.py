"""Sequence sharding for context parallelism with causal load balancing.

With CP = c a sequence is cut into 2c equal chunks and CP rank r holds chunks r and 2c-1-r,
in that order: under a causal mask the early chunk of a rank sees few keys and the late one
many, so every rank does the same attention work. This module is the one place that layout is
defined: the data path (:func:`get_batch_on_this_cp_rank`), ring attention's masks and the
Mamba mixer's switch to head sharding all read it from here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.errors import MegatronConfigError, MegatronInputError
from megatron.core.process_groups import ProcessGroupCollection

CP_COMM_TYPES = ("p2p", "all_gather")


class ContextParallelConfigError(MegatronConfigError):
    """A setting that context parallelism (CP > 1) cannot run with."""


class ContextParallelInputError(MegatronInputError):
    """A tensor that cannot be split over the CP group (e.g. a sequence length not divisible by 2 x CP)."""


def cp_size_of(pg_collection: ProcessGroupCollection) -> int:
    """The CP group size of a collection (1 when it has no ``cp`` group)."""
    return pg_collection.size("cp") if pg_collection.has("cp") else 1


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_divisible(seq_length: int, cp_size: int) -> int:
    """The chunk length ``seq_length / (2 * cp_size)``; ContextParallelInputError when it does not divide."""
    if seq_length % (2 * cp_size):
        raise ContextParallelInputError(
            f"sequence length {seq_length} must be divisible by 2 x context_parallel_size = {2 * cp_size}"
        )
    return seq_length // (2 * cp_size)


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's part of a whole sequence along ``seq_dim``: chunks r and 2c-1-r, concatenated."""
    if cp_size == 1:
        return tensor
    check_divisible(tensor.shape[seq_dim], cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp_size)], dim=seq_dim)


def unshard_sequence(pieces: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every CP rank's part, in CP rank order, to the whole sequence."""
    cp_size = len(pieces)
    if cp_size == 1:
        return pieces[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, piece in enumerate(pieces):
        first, second = piece.chunk(2, dim=seq_dim)
        early, late = chunk_ids(rank, cp_size)
        chunks[early], chunks[late] = first, second
    return torch.cat(chunks, dim=seq_dim)


def natural_order_index(cp_size: int, chunk_length: int, device=None) -> torch.Tensor:
    """Positions into the rank-order concatenation of every CP rank's part (rank 0's two chunks,
    then rank 1's, ...) that put the sequence back in natural order; ``index_select`` with it
    is :func:`unshard_sequence` of an all-gathered tensor, differentiable."""
    order = torch.empty(2 * cp_size, dtype=torch.long)
    for rank in range(cp_size):
        early, late = chunk_ids(rank, cp_size)
        order[early], order[late] = 2 * rank, 2 * rank + 1
    offsets = torch.arange(chunk_length)
    return (order[:, None] * chunk_length + offsets).flatten().to(device)


def local_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions ``[seq_length / cp_size]`` of this CP rank's tokens."""
    return shard_sequence(torch.arange(seq_length, device=device), cp_rank, cp_size, seq_dim=0)


def local_position_ids(tokens: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """Global positions ``[b, s/c]`` of this CP rank's part ``tokens [b, s/c]`` of sequences
    starting at position 0 (what a caller that passes no position ids means)."""
    cp_size = dist.get_world_size(cp_group)
    batch, local_length = tokens.shape
    positions = local_positions(local_length * cp_size, dist.get_rank(cp_group), cp_size, tokens.device)
    return positions.unsqueeze(0).expand(batch, local_length)


def on_whole_sequence(fn, tensor: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``fn`` (a map of whole ``[b, s]`` sequences, e.g. a shift of token ids) applied to this CP
    rank's part ``[b, s/c]``: the parts are all-gathered (no autograd; meant for ids and masks),
    ``fn`` runs on the whole sequence and this rank keeps its part of the result."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return fn(tensor)
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(pieces, tensor.contiguous(), group=cp_group)
    whole = fn(unshard_sequence(pieces, seq_dim=1))
    return shard_sequence(whole, dist.get_rank(cp_group), dist.get_world_size(cp_group), seq_dim=1)


def get_batch_on_this_cp_rank(batch: dict, cp_group: dist.ProcessGroup | None) -> dict:
    """This CP rank's part of a micro-batch of ``[b, s]`` tensors (tokens, labels, loss mask,
    position ids, ...): the one place the data path shards sequences. Non-tensor values and
    tensors without a sequence dim pass through; a 4-D attention mask cannot be sharded this way
    and raises ContextParallelInputError."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return batch
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            out[key] = shard_sequence(value, cp_rank, cp_size, seq_dim=1)
        elif isinstance(value, torch.Tensor) and value.dim() > 2:
            raise ContextParallelInputError(
                f"batch entry {key!r} of shape {tuple(value.shape)} has no [b, s] layout to shard over CP; "
                "context parallelism takes [b, s] tensors (causal attention, no explicit mask)"
            )
        else:
            out[key] = value
    return out
