"""Object collectives over a process group that also work in a single process without
torch.distributed (then the "group" is just this process)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointingError, CheckpointIOError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order (the whole world when None)."""
    if not is_distributed():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def all_gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every member's ``obj``, in group-rank order."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every member's ``obj`` on group rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    is_root = dist.get_rank(group) == 0
    out = [None] * dist.get_world_size(group) if is_root else None
    dist.gather_object(obj, out, dst=group_ranks(group)[0], group=group)
    return out


def broadcast_object(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's ``obj`` on every member."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=group_ranks(group)[0], group=group)
    return box[0]


def on_coordinator(fn, group: dist.ProcessGroup | None):
    """Run ``fn`` on group rank 0 and return its result on every rank, or raise its failure on
    every rank: a refused request as CheckpointingError, anything else (the file system) as
    CheckpointIOError."""
    outcome = None
    if group_rank(group) == 0:
        try:
            outcome = (None, fn())
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            outcome = ((isinstance(exc, CheckpointingError), f"{type(exc).__name__}: {exc}"), None)
    error, value = broadcast_object(outcome, group)
    if error:
        refused, message = error
        raise (CheckpointingError if refused else CheckpointIOError)(f"checkpoint coordinator failed: {message}")
    return value
