"""Save and load sharded state dicts.

``save`` validates the combined sharding of every rank (nothing is written when it is wrong),
writes each main replica once through torch.distributed.checkpoint into a staging directory,
records what landed where (with checksums) in ``metadata.json`` and publishes the directory,
with the files given to publish beside it, by one atomic rename. ``load`` reads any requested
box of any global tensor, so a checkpoint saved under one TP/PP/DP/GTP layout loads under
another. A save is :func:`prepare_save` (this rank's part, no collectives; optionally a
snapshot of its tensors) followed by :meth:`PreparedSave.run` (the collective part), which
``save_iteration`` can hand to a background :class:`~megatron.core.dist_checkpointing.async_save.AsyncSaver`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import dist_utils, object_codec, recovery
from megatron.core.dist_checkpointing.async_save import AsyncSaver, SnapshotArena
from megatron.core.dist_checkpointing.checksums import Checksum, new_hasher
from megatron.core.dist_checkpointing.core import (
    iteration_dir,
    prepare_staging,
    publish,
    reached,
    read_latest_iteration,
    staging_dir,
    write_latest_iteration,
)
from megatron.core.dist_checkpointing.dict_utils import iter_leaves, map_leaves
from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.exchange_utils import AssignmentCache
from megatron.core.dist_checkpointing.lazy_tensor import LazyTensor
from megatron.core.dist_checkpointing.mapping import (
    SHARDED_TYPES,
    ShardedObject,
    ShardedTensor,
    apply_factories,
    merge_factories,
    object_storage_key,
)
from megatron.core.dist_checkpointing.metadata import (
    COMMON_STATE_KEY,
    METADATA_FILENAME,
    CheckpointMetadata,
    StoredChunk,
    StoredFile,
    StoredObjectGrid,
    StoredSlice,
    StoredTensor,
    read_metadata,
)
from megatron.core.dist_checkpointing.strategies import fully_parallel
from megatron.core.dist_checkpointing.strategies.torch_dcp import (
    PieceWrite,
    StoredPiece,
    plan_box_reads,
    read_pieces,
    write_pieces,
)
from megatron.core.dist_checkpointing.validation import ShardRecord, gather_records, validate_records


@dataclass
class _WrittenPiece:
    """What the coordinator needs to describe one written item in the metadata."""

    kind: str  # "tensor", "object" or "common"
    key: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    slice: StoredSlice | None = None  # filled in once DCP has written the piece


def _strip_sharded(tree: Any) -> Any:
    """The common (non-sharded) part of a state dict; sharded list items become None."""
    if isinstance(tree, dict):
        return {k: _strip_sharded(v) for k, v in tree.items() if not isinstance(v, SHARDED_TYPES)}
    if isinstance(tree, list):
        return [None if isinstance(v, SHARDED_TYPES) else _strip_sharded(v) for v in tree]
    return tree


def _sharded_leaves(tree: Any):
    if not isinstance(tree, dict):
        raise CheckpointingError(f"a sharded state dict must be a dict, got {type(tree).__name__}")
    return [(path, leaf) for path, leaf in iter_leaves(tree) if isinstance(leaf, SHARDED_TYPES)]


def _check_keys(leaves) -> None:
    for _, leaf in leaves:
        if leaf.key == COMMON_STATE_KEY:
            raise CheckpointingError(f"key {COMMON_STATE_KEY!r} is reserved for the common state; rename the piece")


@dataclass
class PreparedSave:
    """One rank's part of a save, taken from its sharded state dict by :func:`prepare_save`:
    the records to validate, the tensor pieces it may write, the encoded objects and common
    state, and the other files to publish. Nothing here refers to the state dict's objects
    except the tensors (which are copies when it was prepared with a ``snapshot``)."""

    checkpoint_dir: str
    records: list[ShardRecord]
    tensors: list[tuple[ShardRecord, PieceWrite, _WrittenPiece]]
    objects: list[tuple[PieceWrite, _WrittenPiece]]
    common: tuple[PieceWrite, _WrittenPiece]
    files: dict[str, bytes]
    validate: bool = True
    parallelization_group: dist.ProcessGroup | None = None
    assignment_cache: AssignmentCache | None = None

    def run(self, process_group: dist.ProcessGroup | None = None) -> None:
        """The collective part of the save, over ``process_group`` (default: the world): validate,
        elect writers, write, publish. Raises on every rank when any rank fails
        (CheckpointingError for a refused state dict or path, CheckpointIOError for a failed
        write); then the checkpoint directory does not exist."""
        if self.validate:
            validate_records(gather_records(self.records, process_group))
        if self.parallelization_group is not None:
            parallel_writes = fully_parallel.pieces_to_write(
                self.records, self.parallelization_group, self.assignment_cache
            )
        planned, chunks_planned = [], set()
        for record, piece, written in self.tensors:
            writes_it = record.chunk in parallel_writes if self.parallelization_group is not None else True
            if writes_it and record.chunk not in chunks_planned:
                chunks_planned.add(record.chunk)
                planned.append((piece, written))
        planned += self.objects
        if dist_utils.group_rank(process_group) == 0:
            planned.append(self.common)
        checkpoint_dir = self.checkpoint_dir
        staging = staging_dir(checkpoint_dir)
        dist_utils.on_coordinator(lambda: prepare_staging(checkpoint_dir), process_group)
        landed = write_pieces(staging, [piece for piece, _ in planned], process_group)
        reached("shards_written", staging)
        written = [replace(w, slice=landed[(piece.fqn, piece.global_offset)]) for piece, w in planned]
        gathered = dist_utils.gather_object(written, process_group)
        dist_utils.on_coordinator(
            lambda: publish(
                staging,
                checkpoint_dir,
                self.files,
                METADATA_FILENAME,
                _build_metadata(gathered, self.files).to_json().encode(),
            ),
            process_group,
        )


def _check_file_names(files: dict[str, bytes]) -> None:
    reserved = {METADATA_FILENAME, ".metadata"}
    for name in files:
        parts = name.split("/")
        if os.path.isabs(name) or ".." in parts or "" in parts or name in reserved or name.endswith(".distcp"):
            raise CheckpointingError(
                f"cannot publish a file named {name!r} with a checkpoint: names are relative paths inside the "
                f"checkpoint, without '..', and not {sorted(reserved)} or *.distcp"
            )


def prepare_save(
    sharded_state_dict: dict,
    checkpoint_dir: str,
    *,
    files: dict[str, bytes] | None = None,
    snapshot: SnapshotArena | None = None,
    parallelization_group: dist.ProcessGroup | None = None,
    assignment_cache: AssignmentCache | None = None,
    validate: bool = True,
) -> PreparedSave:
    """This rank's part of a save of ``sharded_state_dict`` into ``checkpoint_dir`` (no
    collectives; run it with :meth:`PreparedSave.run`). Objects and plain values are encoded
    now; with a ``snapshot`` arena the tensor pieces are copied into it (a consistent copy
    that later changes of the state do not reach: device-host copies into pinned memory for
    CUDA tensors), else they are written from the state's own memory when the save runs.
    ``files`` (relative path -> bytes) are published with the checkpoint."""
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    files = dict(files or {})
    _check_file_names(files)
    tree, _ = apply_factories(sharded_state_dict)
    leaves = _sharded_leaves(tree)
    _check_keys(leaves)
    records = [ShardRecord.of(leaf) for _, leaf in leaves]
    tensors, objects = [], []
    for (_, leaf), record in zip(leaves, records, strict=True):
        if isinstance(leaf, ShardedTensor):
            if not leaf.numel or (parallelization_group is None and not leaf.is_main):
                continue
            if leaf.data is None:
                raise CheckpointingError(
                    f"ShardedTensor {leaf.key!r} at offset {leaf.global_offset} has no data to save"
                )
            piece = PieceWrite(leaf.key, leaf.data.reshape(leaf.local_shape), leaf.global_offset, leaf.global_shape)
            written = _WrittenPiece(
                "tensor", leaf.key, leaf.global_offset, leaf.local_shape, leaf.global_shape, record.dtype
            )
            tensors.append((record, piece, written))
        elif leaf.is_main:
            piece = _bytes_piece(leaf.unique_key, object_codec.encode(leaf.data, f"ShardedObject {leaf.key!r}"))
            objects.append(
                (
                    piece,
                    _WrittenPiece(
                        "object", leaf.key, leaf.global_offset, piece.global_shape, leaf.global_shape, "uint8"
                    ),
                )
            )
    if snapshot is not None:
        if any(isinstance(piece.tensor, LazyTensor) for _, piece, _ in tensors):
            raise CheckpointingError("a background save snapshots its tensors; lazy tensors are only read by a save")
        copies = snapshot.copy([piece.tensor for _, piece, _ in tensors])
        tensors = [(r, replace(piece, tensor=copy), w) for (r, piece, w), copy in zip(tensors, copies, strict=True)]
    piece = _bytes_piece(COMMON_STATE_KEY, object_codec.encode(_strip_sharded(tree), "common state"))
    common = (piece, _WrittenPiece("common", COMMON_STATE_KEY, (0,), piece.global_shape, piece.global_shape, "uint8"))
    return PreparedSave(
        checkpoint_dir, records, tensors, objects, common, files, validate, parallelization_group, assignment_cache
    )


def save(
    sharded_state_dict: dict,
    checkpoint_dir: str,
    process_group: dist.ProcessGroup | None = None,
    *,
    files: dict[str, bytes] | None = None,
    parallelization_group: dist.ProcessGroup | None = None,
    assignment_cache: AssignmentCache | None = None,
    validate: bool = True,
) -> None:
    """Collectively save every rank's ``sharded_state_dict`` into ``checkpoint_dir``.

    Every rank of ``process_group`` (default: the world) calls this with the same path (on a
    filesystem they share). Plain values are the common state, saved from group rank 0, and
    ``files`` (relative path -> bytes, given on group rank 0) are published with the checkpoint.
    With ``validate`` the combined sharding is checked first (see ``validation``); with a
    ``parallelization_group`` the writing of replicated pieces is spread over its members
    (optionally cached in ``assignment_cache``). Raises on every rank when any rank fails
    (CheckpointingError for a refused state dict or path, CheckpointIOError for a failed write);
    then ``checkpoint_dir`` does not exist.
    """
    prepare_save(
        sharded_state_dict,
        checkpoint_dir,
        files=files,
        parallelization_group=parallelization_group,
        assignment_cache=assignment_cache,
        validate=validate,
    ).run(process_group)


def _bytes_piece(fqn: str, blob: bytes) -> PieceWrite:
    tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return PieceWrite(fqn, tensor, (0,), (len(blob),))


def _build_metadata(written_by_rank: list[list[_WrittenPiece]], files: dict[str, bytes]) -> CheckpointMetadata:
    metadata = CheckpointMetadata()
    for name, data in files.items():
        hasher = new_hasher()
        hasher.update(data)
        metadata.files[name] = StoredFile(len(data), Checksum.of(hasher))
    for written in written_by_rank:
        for w in written:
            if w.kind == "tensor":
                entry = metadata.tensors.setdefault(w.key, StoredTensor(w.dtype, w.global_shape))
                entry.chunks.append(StoredChunk(w.global_offset, w.local_shape, w.slice))
            elif w.kind == "object":
                grid = metadata.objects.setdefault(w.key, StoredObjectGrid(w.global_shape))
                grid.cells[w.global_offset] = StoredChunk((0,), w.local_shape, w.slice)
            else:
                metadata.common = StoredChunk((0,), w.local_shape, w.slice)
    return metadata


def _stored_tensor_for(leaf: ShardedTensor, metadata: CheckpointMetadata) -> StoredTensor:
    stored = metadata.tensors.get(leaf.key)
    if stored is None:
        known = sorted(metadata.tensors)
        raise CheckpointingError(
            f"tensor {leaf.key!r} is not in the checkpoint; it holds {len(known)} tensors, e.g. {known[:8]}"
        )
    if tuple(stored.global_shape) != leaf.global_shape and not leaf.allow_shape_mismatch:
        raise CheckpointingError(
            f"tensor {leaf.key!r}: the checkpoint holds global shape {tuple(stored.global_shape)} but global shape "
            f"{leaf.global_shape} was requested (set allow_shape_mismatch=True to load the overlap)"
        )
    return stored


def _object_cell_for(leaf: ShardedObject, metadata: CheckpointMetadata) -> StoredChunk:
    grid = metadata.objects.get(leaf.key)
    if grid is None:
        raise CheckpointingError(
            f"object {leaf.key!r} is not in the checkpoint; it holds objects {sorted(metadata.objects)[:8]}"
        )
    if tuple(grid.global_shape) != leaf.global_shape or leaf.global_offset not in grid.cells:
        raise CheckpointingError(
            f"object {leaf.key!r}: cell {leaf.global_offset} of a grid of shape {leaf.global_shape} was requested, "
            f"the checkpoint holds a grid of shape {tuple(grid.global_shape)}"
        )
    return grid.cells[leaf.global_offset]


def _stored_pieces(metadata: CheckpointMetadata) -> dict[tuple, StoredPiece]:
    pieces = {
        (key, c.global_offset): StoredPiece(c.slice, t.dtype, c.local_shape)
        for key, t in metadata.tensors.items()
        for c in t.chunks
    }
    for key, grid in metadata.objects.items():
        for cell, chunk in grid.cells.items():
            pieces[(object_storage_key(key, cell, grid.global_shape), (0,))] = StoredPiece(
                chunk.slice, "uint8", chunk.local_shape
            )
    if metadata.common is not None:
        pieces[(COMMON_STATE_KEY, (0,))] = StoredPiece(metadata.common.slice, "uint8", metadata.common.local_shape)
    return pieces


def load(
    sharded_state_dict: dict,
    checkpoint_dir: str,
    *,
    parallelization_group: dist.ProcessGroup | None = None,
    assignment_cache: AssignmentCache | None = None,
) -> dict:
    """Load the pieces described by ``sharded_state_dict`` from ``checkpoint_dir``.

    Returns a dict of the same structure with each ShardedTensor replaced by a new tensor of
    its data shape and dtype (cast from the stored dtype if they differ) on the device of its
    data (CPU when the request has none; a CUDA one is filled through pinned buffers, its
    host-device copies overlapped with the reads), each ShardedObject by
    its data, each factory by its merged tensor, and the saved common state filled in. Any rank
    may ask for any box of a global tensor. Without a ``parallelization_group`` each rank reads
    alone (no collectives); with one, every member must call and requests shared by its
    members are read once and broadcast. Raises CheckpointingError for a request the checkpoint
    cannot answer, CorruptCheckpointError for truncated or corrupted files and CheckpointIOError
    when reading fails otherwise, naming the key and file at fault.
    """
    metadata = read_metadata(checkpoint_dir)
    tree, factories = apply_factories(sharded_state_dict)
    leaves = _sharded_leaves(tree)
    tensors = [(path, leaf) for path, leaf in leaves if isinstance(leaf, ShardedTensor)]
    records = {record.chunk: record for record in (ShardRecord.of(leaf) for _, leaf in tensors)}
    devices = {ShardRecord.of(leaf).chunk: _device_of(leaf) for _, leaf in tensors}
    stored = {leaf.key: _stored_tensor_for(leaf, metadata) for _, leaf in tensors}
    if parallelization_group is not None:
        to_read, assignment = fully_parallel.pieces_to_read(
            list(records.values()), parallelization_group, assignment_cache
        )
    else:
        to_read = set(records)
    targets, items, loaded = {}, [], {}
    for chunk in to_read:
        record = records[chunk]
        dest = f"{len(targets)}"
        clipped = tuple(stored[record.key].global_shape) != record.global_shape
        targets[dest] = (torch.zeros if clipped else torch.empty)(
            record.local_shape, dtype=getattr(torch, record.dtype), device=devices[chunk]
        )
        items += plan_box_reads(dest, record.key, record.global_offset, record.local_shape, stored[record.key])
        loaded[chunk] = targets[dest]
    objects = {}
    for path, leaf in leaves:
        if isinstance(leaf, ShardedObject):
            cell = _object_cell_for(leaf, metadata)
            objects[path] = _read_bytes_target(
                object_storage_key(leaf.key, leaf.global_offset, leaf.global_shape), cell, targets, items
            )
    if metadata.common is not None:
        common_bytes = _read_bytes_target(COMMON_STATE_KEY, metadata.common, targets, items)
    read_pieces(checkpoint_dir, items, targets, _stored_pieces(metadata))
    if parallelization_group is not None:
        fully_parallel.exchange_loaded(assignment, loaded, set(records), parallelization_group)

    def result_leaf(path, leaf):
        if isinstance(leaf, ShardedTensor):
            return loaded[ShardRecord.of(leaf).chunk].reshape(leaf.data_shape)
        if isinstance(leaf, ShardedObject):
            return object_codec.decode(objects[path].numpy().tobytes(), f"object {leaf.key!r}")
        return leaf

    result = map_leaves(result_leaf, tree)
    if metadata.common is not None:
        common = object_codec.decode(common_bytes.numpy().tobytes(), "common state")
        result = _merge_common(result, common, {path for path, _ in leaves})
    merge_factories(result, factories)
    return result


def _device_of(leaf: ShardedTensor) -> torch.device:
    return leaf.data.device if isinstance(leaf.data, torch.Tensor) else torch.device("cpu")


def _read_bytes_target(fqn: str, chunk: StoredChunk, targets: dict, items: list) -> torch.Tensor:
    dest = f"{len(targets)}"
    targets[dest] = torch.empty(chunk.local_shape, dtype=torch.uint8)
    items += plan_box_reads(dest, fqn, (0,), chunk.local_shape, StoredTensor("uint8", chunk.local_shape, [chunk]))
    return targets[dest]


def _merge_common(result: Any, common: Any, sharded_paths: set, path: tuple = ()) -> Any:
    """``result`` with the saved common state merged in: saved plain values win, loaded
    sharded values stay, containers are merged recursively."""
    if path in sharded_paths:
        return result
    if isinstance(result, dict) and isinstance(common, dict):
        for key, value in common.items():
            result[key] = _merge_common(result[key], value, sharded_paths, path + (key,)) if key in result else value
        return result
    if isinstance(result, list) and isinstance(common, list) and len(result) == len(common):
        return [
            _merge_common(r, c, sharded_paths, path + (i,)) for i, (r, c) in enumerate(zip(result, common, strict=True))
        ]
    return common


def save_iteration(
    sharded_state_dict: dict,
    root: str,
    iteration: int,
    process_group: dist.ProcessGroup | None = None,
    *,
    required_files: tuple[str, ...] = (),
    async_saver: AsyncSaver | None = None,
    on_saved: Callable[[], None] | None = None,
    retain_interval: int | None = None,
    **save_kwargs,
) -> str:
    """Save into ``<root>/iter_XXXXXXX`` and then point the ``latest`` tracker at it; returns
    the directory. ``save_kwargs`` go to :func:`prepare_save` (e.g. ``files``). With
    ``retain_interval`` the older iterations that are not its multiples are deleted once the
    tracker has moved (:func:`recovery.retire_iterations`).

    An ``iter_XXXXXXX`` of this iteration that a save interrupted before it moved the tracker
    (newer than the tracker) is verified first: adopted when complete (the tracker moves to it,
    nothing is written), replaced when not (see ``recovery``; ``required_files`` must be in a
    complete one). With an ``async_saver`` this waits for the save in flight, snapshots the
    state and returns while the save runs in the background over the saver's group;
    ``on_saved()`` runs (on this thread) once the save is complete, at once without a saver.
    """
    path = iteration_dir(root, iteration)
    if async_saver is not None:
        if save_kwargs.get("parallelization_group") is not None:
            raise CheckpointingError(
                "a background save cannot spread its writes over a parallelization_group: its collectives would "
                "run on the training thread's group; save without async_saver"
            )
        async_saver.wait()  # its snapshot arena is about to be reused
    prepared = prepare_save(
        sharded_state_dict, path, snapshot=async_saver.arena if async_saver is not None else None, **save_kwargs
    )

    def job(group):
        if dist_utils.on_coordinator(lambda: recovery.settle_existing(root, iteration, required_files), group):
            return
        prepared.run(group)
        dist_utils.on_coordinator(lambda: write_latest_iteration(root, iteration), group)
        if retain_interval:
            dist_utils.on_coordinator(lambda: recovery.retire_iterations(root, retain_interval), group)

    if async_saver is None:
        job(process_group)
        if on_saved is not None:
            on_saved()
    else:
        async_saver.submit(job, f"iteration {iteration} into {root}", on_saved)
    return path


def load_latest(sharded_state_dict: dict, root: str, **load_kwargs) -> tuple[dict, int]:
    """Load the iteration the tracker in ``root`` names; returns (state dict, iteration)."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        raise CheckpointingError(
            f"{root} has no latest_checkpointed_iteration.txt tracker: nothing has been saved there"
        )
    return load(sharded_state_dict, iteration_dir(root, iteration), **load_kwargs), iteration
