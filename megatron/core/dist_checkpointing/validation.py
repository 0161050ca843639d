"""Global checks of a sharded state dict, run before anything is written.

Every rank's pieces are gathered (``all_gather_object`` on the save group) and checked:
one global shape, dtype and fragmentation per key; exactly one main replica (replica id all
zeros) per logical chunk; main chunks that cover each global tensor with no gap and no
overlap; for objects, one main per grid cell and every cell present. All problems are
reported together, each naming the key, the offsets and the (global) ranks at fault.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass

import torch.distributed as dist

from megatron.core.dist_checkpointing import dist_utils
from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

MAX_REPORTED = 20
_GAP_SEARCH_LIMIT = 1_000_000


@dataclass(frozen=True)
class ShardRecord:
    """What a rank says about one of its pieces (no data): the unit of validation and
    of work distribution. ``chunk`` identifies the logical piece across replicas."""

    kind: str  # "tensor" or "object"
    key: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str | None
    replica_id: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None = None

    @classmethod
    def of(cls, sharded: ShardedTensor | ShardedObject) -> ShardRecord:
        if isinstance(sharded, ShardedTensor):
            return cls(
                "tensor",
                sharded.key,
                sharded.global_offset,
                sharded.local_shape,
                sharded.global_shape,
                str(sharded.dtype).removeprefix("torch."),
                sharded.replica_id,
                sharded.axis_fragmentations,
            )
        return cls(
            "object",
            sharded.key,
            sharded.global_offset,
            (1,) * len(sharded.global_shape),
            sharded.global_shape,
            None,
            sharded.replica_id,
        )

    @property
    def chunk(self) -> tuple[str, str, tuple[int, ...], tuple[int, ...]]:
        return (self.kind, self.key, self.global_offset, self.local_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def is_main(self) -> bool:
        return is_main_replica(self.replica_id)


def gather_records(records: list[ShardRecord], group: dist.ProcessGroup | None) -> dict[int, list[ShardRecord]]:
    """Every member's records, keyed by global rank."""
    return dict(zip(dist_utils.group_ranks(group), dist_utils.all_gather_object(records, group), strict=True))


def validate_records(records_by_rank: dict[int, list[ShardRecord]]) -> None:
    """Raise CheckpointingError listing every problem of the combined sharding."""
    by_key: dict[str, list[tuple[int, ShardRecord]]] = defaultdict(list)
    for rank, records in sorted(records_by_rank.items()):
        for record in records:
            by_key[record.key].append((rank, record))
    problems = []
    for key, entries in by_key.items():
        problems += _check_key(key, entries)
    if problems:
        shown = problems[:MAX_REPORTED]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise CheckpointingError(
            f"sharded state dict failed validation ({len(problems)} problem(s)); nothing was written:\n  - "
            + "\n  - ".join(shown)
            + more
        )


def _ranks_by(entries, attribute):
    groups = defaultdict(list)
    for rank, record in entries:
        groups[getattr(record, attribute)].append(rank)
    return groups


def _describe(groups) -> str:
    return "; ".join(f"{value} on ranks {sorted(set(ranks))}" for value, ranks in groups.items())


def _check_key(key, entries) -> list[str]:
    kinds = _ranks_by(entries, "kind")
    if len(kinds) > 1:
        return [
            f"key {key!r} is used both as a ShardedTensor (ranks {sorted(set(kinds['tensor']))}) and as a "
            f"ShardedObject (ranks {sorted(set(kinds['object']))})"
        ]
    problems = []
    for attribute, what in (
        ("global_shape", "global shape"),
        ("dtype", "dtype"),
        ("axis_fragmentations", "axis_fragmentations"),
    ):
        groups = _ranks_by(entries, attribute)
        if len(groups) > 1:
            problems.append(f"key {key!r}: {what} differs across ranks: {_describe(groups)}")
    if problems:
        return problems
    chunks: dict[tuple, list[tuple[int, ShardRecord]]] = defaultdict(list)
    for rank, record in entries:
        if record.numel:
            chunks[record.chunk].append((rank, record))
    for (_, _, offset, shape), holders in chunks.items():
        mains = sorted(rank for rank, record in holders if record.is_main)
        if len(mains) > 1:
            problems.append(
                f"key {key!r}: {len(mains)} main replicas for the chunk at offset {offset} shape {shape} on ranks "
                f"{mains}; exactly one rank may hold it with replica_id all zeros"
            )
        elif not mains:
            problems.append(
                f"key {key!r}: no main replica for the chunk at offset {offset} shape {shape} held by ranks "
                f"{sorted({rank for rank, _ in holders})}; one of them needs replica_id all zeros"
            )
    global_shape = entries[0][1].global_shape
    boxes = [(offset, shape, min(rank for rank, _ in holders)) for (_, _, offset, shape), holders in chunks.items()]
    if entries[0][1].kind == "object":
        return problems + _check_object_cells(key, global_shape, boxes)
    return problems + _check_cover(key, global_shape, boxes)


def _boxes_overlap(a, b) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))


def _check_cover(key, global_shape, boxes) -> list[str]:
    problems = []
    active: list = []
    for box in sorted(boxes):
        start = box[0][0] if box[0] else 0
        active = [a for a in active if not a[0] or a[0][0] + a[1][0] > start]
        for other in active:
            if _boxes_overlap(other, box):
                problems.append(
                    f"key {key!r}: main chunks overlap: offset {other[0]} shape {other[1]} (rank {other[2]}) and "
                    f"offset {box[0]} shape {box[1]} (rank {box[2]})"
                )
        active.append(box)
    covered = sum(math.prod(shape) for _, shape, _ in boxes)
    total = math.prod(global_shape)
    if not problems and covered != total:
        problems.append(
            f"key {key!r}: gap: {_first_uncovered(global_shape, boxes)}; main chunks cover {covered} of {total} "
            f"elements of global shape {global_shape}"
        )
    return problems


def _first_uncovered(global_shape, boxes) -> str:
    """The first cell of the grid spanned by all chunk boundaries that no chunk covers."""
    edges = [
        sorted({0, size} | {o for box in boxes for o in (box[0][d], box[0][d] + box[1][d])})
        for d, size in enumerate(global_shape)
    ]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells * max(len(boxes), 1) > _GAP_SEARCH_LIMIT:
        return "no main chunk covers part of the tensor"
    for starts in itertools.product(*(range(len(e) - 1) for e in edges)):
        offset = tuple(edges[d][i] for d, i in enumerate(starts))
        shape = tuple(edges[d][i + 1] - edges[d][i] for d, i in enumerate(starts))
        if not any(_boxes_overlap((offset, shape), box) for box in boxes):
            return f"no main chunk covers offset {offset} shape {shape}"
    return "no main chunk covers part of the tensor"


def _check_object_cells(key, global_shape, boxes) -> list[str]:
    present = {offset for offset, _, _ in boxes}
    missing = [cell for cell in itertools.product(*(range(s) for s in global_shape)) if cell not in present]
    if not missing:
        return []
    return [f"object {key!r}: no rank holds the cells at offsets {missing[:8]} of the grid of shape {global_shape}"]
