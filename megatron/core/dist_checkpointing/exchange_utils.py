"""Who writes (reads) which piece inside a parallelization group, and a cache of that answer.

The assignment is a deterministic greedy: pieces from largest to smallest (ties by key and
offset), each to the least loaded candidate rank (ties by lower rank). It is computed from
every member's piece records, gathered once on the group.

:class:`AssignmentCache` remembers assignments in memory and, optionally, as JSON files in a
directory shared by the group's ranks. An entry's key hashes the purpose ("save"/"load"), the
**complete ordered membership** of the group and this rank's piece structure (keys, offsets,
shapes, dtypes; replica ids excluded since replicas of a group differ only there), so two
groups that share a first rank never share an entry. A hit costs no collective. Each entry
file is written by one rank: the lowest-ranked member whose key it is. The cache must be
used, and cleared, the same way on every member of a group: a member that misses while its
peers hit would wait in the gather alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass

import torch

from megatron.core.dist_checkpointing import dist_utils
from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.validation import ShardRecord

Chunk = tuple  # ShardRecord.chunk: (kind, key, global_offset, local_shape)

# Counters for tests and logs: gathers run to compute an assignment, and cache files written,
# each keyed by the group's ordered membership.
GATHER_COUNTS: Counter = Counter()
CACHE_FILE_WRITES: Counter = Counter()


def record_nbytes(record: ShardRecord) -> int:
    return record.numel * torch.empty((), dtype=getattr(torch, record.dtype)).element_size()


@dataclass(frozen=True)
class AssignedPiece:
    chunk: Chunk
    dtype: str
    rank: int  # global rank that writes (or reads and then shares) the piece


@dataclass(frozen=True)
class Assignment:
    """The pieces a group handles and the rank responsible for each, in greedy order."""

    members: tuple[int, ...]
    pieces: tuple[AssignedPiece, ...]

    def owned_by(self, rank: int) -> set[Chunk]:
        return {p.chunk for p in self.pieces if p.rank == rank}

    def to_json(self) -> dict:
        return {
            "members": list(self.members),
            "pieces": [
                [p.chunk[0], p.chunk[1], list(p.chunk[2]), list(p.chunk[3]), p.dtype, p.rank] for p in self.pieces
            ],
        }

    @classmethod
    def from_json(cls, raw: dict) -> Assignment:
        return cls(
            tuple(raw["members"]),
            tuple(AssignedPiece((k, key, tuple(o), tuple(s)), d, r) for k, key, o, s, d, r in raw["pieces"]),
        )


def greedy_assign(candidates: dict[Chunk, list[int]], nbytes: dict[Chunk, int]) -> dict[Chunk, int]:
    """Largest piece first, to the least loaded candidate; ties by piece id, then by rank."""
    load: Counter = Counter()
    owner = {}
    for chunk in sorted(candidates, key=lambda c: (-nbytes[c], c)):
        rank = min(candidates[chunk], key=lambda r: (load[r], r))
        owner[chunk] = rank
        load[rank] += nbytes[chunk]
    return owner


def compute_assignment(purpose: str, records_by_member: dict[int, list[ShardRecord]]) -> Assignment:
    """``save``: every tensor piece whose main replica is in the group goes to one of its
    holders in the group. ``load``: every piece requested by two or more members goes to one of
    the requesters, who reads it and shares it."""
    holders: dict[Chunk, list[int]] = {}
    has_main: set[Chunk] = set()
    meta: dict[Chunk, ShardRecord] = {}
    for rank, records in records_by_member.items():
        for record in records:
            if record.kind != "tensor" or not record.numel:
                continue
            holders.setdefault(record.chunk, []).append(rank)
            meta[record.chunk] = record
            if record.is_main:
                has_main.add(record.chunk)
    if purpose == "save":
        candidates = {c: r for c, r in holders.items() if c in has_main}
    else:
        candidates = {c: r for c, r in holders.items() if len(r) > 1}
    nbytes = {c: record_nbytes(meta[c]) for c in candidates}
    owner = greedy_assign(candidates, nbytes)
    ordered = sorted(owner, key=lambda c: (-nbytes[c], c))
    return Assignment(tuple(records_by_member), tuple(AssignedPiece(c, meta[c].dtype, owner[c]) for c in ordered))


def cache_key(purpose: str, members: tuple[int, ...], records: list[ShardRecord]) -> str:
    """Hash of the purpose, the ordered membership and this rank's piece structure."""
    structure = sorted({(r.kind, r.key, r.global_offset, r.local_shape, r.global_shape, r.dtype) for r in records})
    payload = json.dumps([purpose, list(members), structure], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


class AssignmentCache:
    """In-memory (and optionally on-disk) cache of assignments; see the module docstring."""

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self._memory: dict[str, Assignment] = {}

    def clear_memory(self) -> None:
        self._memory.clear()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"assignment-{key}.json")

    def lookup(self, key: str, members: tuple[int, ...]) -> Assignment | None:
        if key in self._memory:
            return self._memory[key]
        if self.directory is None or not os.path.isfile(self._path(key)):
            return None
        with open(self._path(key), encoding="utf-8") as f:
            raw = json.load(f)
        if raw.get("key") != key or tuple(raw["assignment"]["members"]) != members:
            raise CheckpointingError(
                f"assignment cache file {self._path(key)} does not belong to group {list(members)}; "
                "clear the cache directory on every rank"
            )
        assignment = Assignment.from_json(raw["assignment"])
        self._memory[key] = assignment
        return assignment

    def store(self, key: str, assignment: Assignment, write_file: bool) -> None:
        self._memory[key] = assignment
        if self.directory is None or not write_file:
            return
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{self._path(key)}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": key, "assignment": assignment.to_json()}, f)
        os.replace(tmp, self._path(key))
        CACHE_FILE_WRITES[assignment.members] += 1


def distribute(purpose: str, records: list[ShardRecord], group, cache: AssignmentCache | None = None) -> Assignment:
    """The group's assignment for ``purpose``: from the cache, or from one gather on ``group``."""
    members = tuple(dist_utils.group_ranks(group))
    key = cache_key(purpose, members, records) if cache is not None else None
    if cache is not None:
        hit = cache.lookup(key, members)
        if hit is not None:
            return hit
    GATHER_COUNTS[members] += 1
    records_by_member = dict(zip(members, dist_utils.all_gather_object(records, group), strict=True))
    assignment = compute_assignment(purpose, records_by_member)
    if cache is not None:
        me = members[dist_utils.group_rank(group)]
        writer = min(m for m, recs in records_by_member.items() if cache_key(purpose, members, recs) == key)
        cache.store(key, assignment, write_file=writer == me)
    return assignment
