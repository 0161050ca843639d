"""What a rank contributes to a checkpoint: pieces of global tensors and of global objects.

A sharded state dict is a nested dict/list whose leaves are :class:`ShardedTensor`,
:class:`ShardedObject`, :class:`ShardedTensorFactory` or plain values. Plain values form the
"common" state, identical on every rank, written once by the coordinator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.core.dist_checkpointing.dict_utils import TreePath, get_path, iter_leaves, map_leaves, set_path
from megatron.core.dist_checkpointing.errors import CheckpointingError

ReplicaId = tuple[int, ...]


def _as_replica_id(replica_id: int | tuple[int, ...]) -> ReplicaId:
    rid = (replica_id,) if isinstance(replica_id, int) else tuple(int(r) for r in replica_id)
    if not rid or any(r < 0 for r in rid):
        raise CheckpointingError(
            f"replica_id must be a non-negative int or a non-empty tuple of them, got {replica_id!r}"
        )
    return rid


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (the one that is written) has a replica id of all zeros."""
    return all(r == 0 for r in replica_id)


@dataclass
class ShardedTensor:
    """A local piece of the global tensor ``key``.

    The piece spans ``global_offset[d] : global_offset[d] + local_shape[d]`` on every axis of a
    tensor of ``global_shape``. Offsets are exact element positions (uneven pieces are fine).
    The first ``prepend_axis_num`` axes exist only globally (e.g. stacked layers): ``data``
    lacks them and ``local_shape`` has size 1 there. ``axis_fragmentations`` (how many pieces
    each axis is cut into, or None when irregular) is checked for consistency across ranks.
    ``replica_id`` is all zeros on the one rank whose copy is written (the main replica).
    ``allow_shape_mismatch`` lets a load read this piece from a checkpoint whose global shape
    differs (e.g. a vocabulary padded for another TP size): the overlap is read, the rest is zero.
    """

    key: str
    data: torch.Tensor | None
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = (0,)
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False

    def __post_init__(self):
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(o) for o in self.global_offset)
        self.replica_id = _as_replica_id(self.replica_id)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(f) for f in self.axis_fragmentations)
        ndim = len(self.global_shape)
        where = f"ShardedTensor {self.key!r}"
        if len(self.local_shape) != ndim or len(self.global_offset) != ndim:
            raise CheckpointingError(
                f"{where}: local_shape {self.local_shape}, global_offset {self.global_offset} and global_shape "
                f"{self.global_shape} must have the same number of axes"
            )
        if self.axis_fragmentations is not None and (
            len(self.axis_fragmentations) != ndim or any(f < 1 for f in self.axis_fragmentations)
        ):
            raise CheckpointingError(
                f"{where}: axis_fragmentations {self.axis_fragmentations} must give a count >= 1 for each of the "
                f"{ndim} axes"
            )
        for axis, (off, size, total) in enumerate(
            zip(self.global_offset, self.local_shape, self.global_shape, strict=True)
        ):
            if off < 0 or size < 0 or off + size > total:
                raise CheckpointingError(
                    f"{where}: axis {axis} spans [{off}, {off + size}) which is outside the global size {total}"
                )
        if not 0 <= self.prepend_axis_num <= ndim or any(s != 1 for s in self.local_shape[: self.prepend_axis_num]):
            raise CheckpointingError(
                f"{where}: prepend_axis_num={self.prepend_axis_num} needs local size 1 on the first "
                f"{self.prepend_axis_num} axes, got local_shape {self.local_shape}"
            )
        if self.data is not None:
            if tuple(self.data.shape) != self.data_shape:
                raise CheckpointingError(
                    f"{where}: data has shape {tuple(self.data.shape)} but local_shape {self.local_shape} "
                    f"(prepend_axis_num={self.prepend_axis_num}) needs {self.data_shape}"
                )
            if self.data.dtype != self.dtype:
                raise CheckpointingError(
                    f"{where}: data has dtype {self.data.dtype} but dtype {self.dtype} was declared"
                )

    @property
    def data_shape(self) -> tuple[int, ...]:
        """Shape of ``data``: the local shape without the prepended axes."""
        return self.local_shape[self.prepend_axis_num :]

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def is_main(self) -> bool:
        return is_main_replica(self.replica_id)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: int | tuple[int, ...] = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
    ) -> ShardedTensor:
        """Piece of an evenly split tensor: each ``(axis, rank, num_fragments)`` says that the
        global ``axis`` is cut into ``num_fragments`` equal parts and ``data`` is part ``rank``.

        Axes are global axes (prepended axes first); a prepended axis has global size
        ``num_fragments`` and this piece sits at index ``rank`` of it.
        """
        local_shape = (1,) * prepend_axis_num + tuple(data.shape)
        ndim = len(local_shape)
        global_shape, offsets, fragments = list(local_shape), [0] * ndim, [1] * ndim
        seen = set()
        for axis, rank, num_fragments in rank_offsets:
            if not 0 <= axis < ndim or axis in seen:
                raise CheckpointingError(
                    f"ShardedTensor {key!r}: rank offset axis {axis} must be a distinct axis in [0, {ndim})"
                )
            if not 0 <= rank < num_fragments:
                raise CheckpointingError(
                    f"ShardedTensor {key!r}: rank {rank} on axis {axis} must be in [0, {num_fragments})"
                )
            seen.add(axis)
            global_shape[axis] = local_shape[axis] * num_fragments
            offsets[axis] = rank * local_shape[axis]
            fragments[axis] = num_fragments
        return cls(
            key,
            data,
            data.dtype,
            local_shape,
            tuple(global_shape),
            tuple(offsets),
            tuple(fragments),
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            allow_shape_mismatch=allow_shape_mismatch,
        )


@dataclass
class ShardedObject:
    """One cell of a grid of objects ``key`` of ``global_shape`` (e.g. one RNG state per
    (pp, tp) rank), at ``global_offset``. ``data`` must be serializable without pickle: JSON
    values, lists, tuples, dicts, torch tensors and numpy arrays (see ``object_codec``)."""

    key: str
    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = (0,)

    def __post_init__(self):
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(o) for o in self.global_offset)
        self.replica_id = _as_replica_id(self.replica_id)
        if len(self.global_shape) != len(self.global_offset) or any(
            not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape, strict=True)
        ):
            raise CheckpointingError(
                f"ShardedObject {self.key!r}: global_offset {self.global_offset} is not a cell of a grid of "
                f"shape {self.global_shape}"
            )

    @property
    def is_main(self) -> bool:
        return is_main_replica(self.replica_id)

    @property
    def unique_key(self) -> str:
        """The storage name of this cell: ``key/shard_<offset>_<shape>``."""
        return object_storage_key(self.key, self.global_offset, self.global_shape)


def object_storage_key(key: str, global_offset: tuple[int, ...], global_shape: tuple[int, ...]) -> str:
    offset = ".".join(str(o) for o in global_offset)
    shape = ".".join(str(s) for s in global_shape)
    return f"{key}/shard_{offset}_{shape}"


@dataclass
class ShardedTensorFactory:
    """A local tensor stored as several sharded pieces (e.g. one global tensor per packed part).

    ``build_fn(key, data, replica_id)`` returns a nested dict/list of :class:`ShardedTensor`
    (and :class:`ShardedObject`) describing ``data``; ``merge_fn(loaded)`` receives the same
    structure with the loaded tensors in place of the sharded leaves and returns the local tensor.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[[str, torch.Tensor, ReplicaId], Any]
    merge_fn: Callable[[Any], torch.Tensor]
    replica_id: ReplicaId = field(default=(0,))

    def __post_init__(self):
        self.replica_id = _as_replica_id(self.replica_id)

    def build(self) -> Any:
        return self.build_fn(self.key, self.data, self.replica_id)


SHARDED_TYPES = (ShardedTensor, ShardedObject)


def apply_factories(sharded_state_dict: Any) -> tuple[Any, list[tuple[TreePath, ShardedTensorFactory]]]:
    """Replace every factory by what it builds; return the new tree and the factories by path."""
    factories = []

    def build(path, leaf):
        if not isinstance(leaf, ShardedTensorFactory):
            return leaf
        if not path:
            raise CheckpointingError(
                "a ShardedTensorFactory cannot be the whole sharded state dict; put it under a key"
            )
        built = leaf.build()
        for sub_path, sub_leaf in iter_leaves(built):
            if not isinstance(sub_leaf, SHARDED_TYPES):
                raise CheckpointingError(
                    f"ShardedTensorFactory {leaf.key!r} built a {type(sub_leaf).__name__} at {path + sub_path}; "
                    "a factory must build only ShardedTensor / ShardedObject leaves"
                )
        factories.append((path, leaf))
        return built

    return map_leaves(build, sharded_state_dict), factories


def merge_factories(loaded: Any, factories: list[tuple[TreePath, ShardedTensorFactory]]) -> None:
    """In the loaded tree, replace each factory's built sub-tree by ``merge_fn`` of it (in place)."""
    for path, factory in factories:
        set_path(loaded, path, factory.merge_fn(get_path(loaded, path)))
