"""Fully parallel save/load: spread the write (read) work over a parallelization group.

Save: each tensor piece whose main replica lives in the group is written by one of its
holders chosen by the greedy assignment, so replicas share the writing instead of the main
replica writing alone. Load: each piece requested by several members is read by one of them
and broadcast to the group (one broadcast per reading rank, pieces packed as bytes).
Objects and the common state are small and are not distributed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import dist_utils
from megatron.core.dist_checkpointing.exchange_utils import Assignment, AssignmentCache, Chunk, distribute
from megatron.core.dist_checkpointing.validation import ShardRecord


def my_global_rank(group) -> int:
    return dist_utils.group_ranks(group)[dist_utils.group_rank(group)]


def pieces_to_write(records: list[ShardRecord], group, cache: AssignmentCache | None) -> set[Chunk]:
    """Tensor chunks this rank writes under the group's save assignment."""
    return distribute("save", records, group, cache).owned_by(my_global_rank(group))


def pieces_to_read(records: list[ShardRecord], group, cache: AssignmentCache | None) -> tuple[set[Chunk], Assignment]:
    """Tensor chunks this rank reads itself (its unshared requests plus the shared ones it was
    assigned), and the group's load assignment for :func:`exchange_loaded`."""
    assignment = distribute("load", records, group, cache)
    shared = {p.chunk for p in assignment.pieces}
    requested = {r.chunk for r in records if r.kind == "tensor"}
    return (requested - shared) | assignment.owned_by(my_global_rank(group)), assignment


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_loaded(assignment: Assignment, loaded: dict[Chunk, torch.Tensor], wanted: set[Chunk], group) -> None:
    """Broadcast the shared pieces from the ranks that read them; store the ``wanted`` ones
    into ``loaded`` (pieces are kept in their full local shape)."""
    if len(assignment.members) < 2:
        return
    me = my_global_rank(group)
    device = _comm_device(group)
    for source in assignment.members:
        pieces = [p for p in assignment.pieces if p.rank == source]
        if not pieces:
            continue
        dtypes = [getattr(torch, p.dtype) for p in pieces]
        sizes = [
            math.prod(p.chunk[3]) * torch.empty((), dtype=d).element_size() for p, d in zip(pieces, dtypes, strict=True)
        ]
        if me == source:
            buffer = torch.cat([loaded[p.chunk].reshape(-1).view(torch.uint8) for p in pieces]).to(device)
        else:
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=source, group=group)
        if me == source:
            continue
        for piece, dtype, part in zip(pieces, dtypes, buffer.cpu().split(sizes), strict=True):
            if piece.chunk in wanted:
                loaded[piece.chunk] = part.clone().view(dtype).reshape(piece.chunk[3])
