"""Writing and reading sharded pieces through torch.distributed.checkpoint (DCP).

Save: every piece a rank writes becomes a DCP ``SHARD`` write item of the global tensor named
by its key, with its global offset and shape as chunk metadata; DCP plans the save and its
coordinator writes the ``.metadata`` that torch's own tooling (``format_utils.dcp_to_torch_save``,
``dcp.load`` with a plain state dict) understands. The storage writer below lays each item out
as DCP's ``FileSystemWriter`` does, a ``torch.save`` archive of the tensor (so torch's readers
still open it), but writes it in one pass: ``torch.save`` under ``skip_data`` writes the archive's
records around a reserved gap, which the writer fills with the tensor's raw bytes in large
sequential writes, hashing everything as it goes (never re-reading the file). It records where
each item landed, where its raw bytes start and their checksum. (The zip CRC fields of the data
records stay zero, as with ``skip_data``: the checksum in our metadata is the integrity check.)

Load: a planner turns each requested box into DCP read items against the stored chunks
(resharding to any layout); the reader below reads only byte ranges named in our JSON
metadata, straight into the destination tensor when a read covers a whole stored chunk of the
same dtype (else into one scratch tensor), verifying length and checksum on the way. Format 1
items (no recorded data offset) are decoded with ``torch.load(weights_only=True)``. DCP's
pickled ``.metadata`` is never read.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, WriteResult
from torch.futures import Future

from megatron.core.dist_checkpointing import dist_utils
from megatron.core.dist_checkpointing.checksums import Checksum, new_hasher
from megatron.core.dist_checkpointing.core import reached
from megatron.core.dist_checkpointing.errors import CheckpointingError, CheckpointIOError, CorruptCheckpointError
from megatron.core.dist_checkpointing.lazy_tensor import LazyTensor
from megatron.core.dist_checkpointing.metadata import StoredSlice, StoredTensor
from megatron.core.dist_checkpointing.strategies.stream_io import (
    SequentialWriter,
    StreamIO,
    hash_range,
    read_into,
    read_small,
)

PieceIndex = tuple[str, tuple[int, ...]]  # (DCP fqn, global offset)
FILE_SUFFIX = ".distcp"


@dataclass
class PieceWrite:
    """One piece this rank writes: ``tensor`` at ``global_offset`` of the global tensor ``fqn``."""

    fqn: str
    tensor: torch.Tensor | LazyTensor
    global_offset: tuple[int, ...]
    global_shape: tuple[int, ...]


@dataclass(frozen=True)
class StoredPiece:
    """A stored item as the reader needs it: where its bytes are, its dtype and chunk shape."""

    slice: StoredSlice
    dtype: str
    shape: tuple[int, ...]


class _PieceSavePlanner(DefaultSavePlanner):
    """DCP's default global planning (metadata, chunk-cover check) over our pieces."""

    def __init__(self, pieces: list[PieceWrite]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {(p.fqn, tuple(p.global_offset)): p for p in pieces}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(p.fqn, torch.Size(p.global_offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.global_offset), sizes=p.tensor.shape),
                    properties=TensorProperties(dtype=p.tensor.dtype),
                    size=torch.Size(p.global_shape),
                ),
            )
            for p in self._pieces.values()
        ]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        tensor = self._pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor
        return tensor.materialize() if isinstance(tensor, LazyTensor) else tensor.detach()

    def reads_lazily(self, write_item: WriteItem) -> bool:
        """Whether the piece's tensor is read only now (a :class:`LazyTensor`)."""
        return isinstance(self._pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor, LazyTensor)


class _ItemStream:
    """The file ``torch.save`` writes one item into: records go to the writer, and the gap that
    ``skip_data`` reserves for the tensor's bytes (a relative seek) is filled with them."""

    def __init__(self, writer: SequentialWriter, tensor: torch.Tensor, hasher):
        self._writer, self._tensor, self._hasher = writer, tensor, hasher
        self.data_position: int | None = None

    def write(self, data) -> int:
        self._writer.write_small(data, self._hasher)
        return memoryview(data).nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        nbytes = self._tensor.numel() * self._tensor.element_size()
        if whence != os.SEEK_CUR or offset != nbytes or self.data_position is not None:
            raise CheckpointIOError(
                f"torch.save reserved {offset} bytes (whence {whence}) for a tensor of {nbytes} bytes; this torch "
                "version lays archives out differently than this writer expects"
            )
        self.data_position = self._writer.position
        self._writer.write_tensor(self._tensor, self._hasher)
        return self._writer.position

    def flush(self) -> None:
        pass


def write_item(writer: SequentialWriter, tensor: torch.Tensor) -> tuple[int, int, Checksum]:
    """Append ``tensor`` to ``writer``'s file as a ``torch.save`` archive; returns the item's
    length, where its raw bytes start inside it, and its checksum."""
    source = tensor.detach()
    if not source.is_contiguous():
        source = source.contiguous()
    start, hasher = writer.position, new_hasher()
    stream = _ItemStream(writer, source, hasher)
    with torch.serialization.skip_data():
        torch.save(torch.empty(source.shape, dtype=source.dtype), stream)  # a CPU placeholder: never read
    data_position = stream.data_position if stream.data_position is not None else writer.position
    return writer.position - start, data_position - start, Checksum.of(hasher)


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's file writer with the one-pass item writes described in the module docstring: one
    file per rank, fsynced; ``self.written`` maps piece index -> StoredSlice."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.written: dict[PieceIndex, StoredSlice] = {}

    def write_data(self, plan: SavePlan, planner) -> Future:
        relative_path = f"{plan.storage_data.prefix}0{FILE_SUFFIX}"
        results = []
        if plan.items:
            with StreamIO() as stream_io:
                writer = SequentialWriter(os.path.join(self.path, relative_path), stream_io)
                try:
                    for item in plan.items:
                        start = writer.position
                        lazy = planner.reads_lazily(item)
                        length, data_offset, checksum = write_item(writer, planner.resolve_data(item))
                        if lazy:  # its writes done, the tensor read for it is freed before the next is read
                            writer.drain()
                        index = (item.index.fqn, tuple(item.index.offset))
                        self.written[index] = StoredSlice(relative_path, start, length, checksum, data_offset)
                        results.append(WriteResult(item.index, length, _StorageInfo(relative_path, start, length)))
                        reached("item_written", str(self.path))
                finally:
                    writer.close(fsync=True)
        future: Future = Future()
        future.set_result(results)
        return future


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class _PieceLoadPlanner(LoadPlanner):
    """Executes a precomputed list of read items into ``targets`` (dest fqn -> tensor)."""

    def __init__(self, items: list[ReadItem], targets: dict[str, torch.Tensor]):
        self._items = items
        self._targets = targets

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict = state_dict

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise CheckpointingError(
            f"unexpected byte item {read_item.storage_index.fqn!r}: this format stores only tensors"
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return _narrow(self._targets[read_item.dest_index.fqn], read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor):
        pass


def _torch_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where} names an unknown dtype {name!r}")
    return dtype


def _check_checksum(hasher, stored: StoredSlice, path: str, what: str) -> None:
    actual = Checksum.of(hasher, stored.checksum.algorithm)
    if actual != stored.checksum:
        raise CorruptCheckpointError(
            f"{path} is corrupted: {what} ({stored.length} bytes at offset {stored.offset}) has {actual}, the "
            f"checkpoint recorded {stored.checksum}"
        )


def _open_checkpoint_file(checkpoint_dir: str, relative_path: str) -> tuple[str, int]:
    path = os.path.join(checkpoint_dir, relative_path)
    try:
        return path, os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing from the checkpoint") from None


def _check_length(path: str, fd: int, stored: StoredSlice, what: str) -> None:
    size = os.fstat(fd).st_size
    if size < stored.offset + stored.length:
        raise CorruptCheckpointError(
            f"{path} is truncated: {what} needs {stored.length} bytes at offset {stored.offset}, found "
            f"{max(0, size - stored.offset)}"
        )


class VerifiedReader(StorageReader):
    """Reads the byte ranges our JSON metadata names (see the module docstring)."""

    def __init__(self, checkpoint_dir: str, pieces: dict[PieceIndex, StoredPiece]):
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        self._pieces = pieces

    def reset(self, checkpoint_id=None):
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return Metadata(state_dict_metadata={})

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        by_piece: dict[PieceIndex, list[ReadItem]] = {}
        for item in plan.items:
            by_piece.setdefault((item.storage_index.fqn, tuple(item.storage_index.offset)), []).append(item)
        by_file: dict[str, list[PieceIndex]] = {}
        for piece in by_piece:
            by_file.setdefault(self._pieces[piece].slice.file, []).append(piece)
        with StreamIO() as stream_io:
            for relative_path, pieces in sorted(by_file.items()):
                path, fd = _open_checkpoint_file(self.checkpoint_dir, relative_path)
                try:
                    for piece in sorted(pieces, key=lambda p: self._pieces[p].slice.offset):
                        stored = self._pieces[piece]
                        what = f"item {piece[0]!r}"
                        _check_length(path, fd, stored.slice, what)
                        if stored.slice.data_offset is None:
                            self._read_archive(fd, path, what, stored, by_piece[piece], planner)
                        else:
                            self._read_raw(stream_io, fd, path, what, stored, by_piece[piece], planner)
                finally:
                    os.close(fd)
        future: Future = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _read_archive(fd, path, what, stored: StoredPiece, items, planner) -> None:
        """Format 1: the whole item, verified, decoded by ``torch.load(weights_only=True)``."""
        raw = read_small(fd, stored.slice.offset, stored.slice.length)
        hasher = new_hasher(stored.slice.checksum.algorithm)
        hasher.update(raw)
        _check_checksum(hasher, stored.slice, path, what)
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any decoding failure is a damaged item
            raise CorruptCheckpointError(f"{path}: {what} does not decode: {type(err).__name__}: {err}") from None
        for item in items:
            planner.resolve_tensor(item).detach().copy_(_narrow(tensor, item.storage_offsets, item.lengths))

    @staticmethod
    def _read_raw(stream_io, fd, path, what, stored: StoredPiece, items, planner) -> None:
        """Format 2: the archive's records are hashed, its raw tensor bytes are read into the
        target itself when one read covers the whole chunk in its dtype, else into a scratch
        tensor that the reads are copied from."""
        stored_slice = stored.slice
        dtype = _torch_dtype(stored.dtype, f"the metadata of {what}")
        nbytes = math.prod(stored.shape) * dtype.itemsize
        tail = stored_slice.length - stored_slice.data_offset - nbytes
        if stored_slice.data_offset < 0 or tail < 0:
            raise CorruptCheckpointError(
                f"the metadata of {what} in {path} is inconsistent: {nbytes} data bytes at {stored_slice.data_offset} "
                f"do not fit an item of {stored_slice.length} bytes"
            )
        target = planner.resolve_tensor(items[0]).detach() if len(items) == 1 else None
        direct = (
            target is not None
            and target.dtype == dtype
            and target.is_contiguous()
            and tuple(target.shape) == tuple(stored.shape)
            and not any(items[0].storage_offsets)
        )
        dest = target if direct else torch.empty(stored.shape, dtype=dtype)
        hasher = new_hasher(stored_slice.checksum.algorithm)
        start = stored_slice.offset
        hasher.update(read_small(fd, start, stored_slice.data_offset))
        read_into(stream_io, fd, start + stored_slice.data_offset, dest, hasher)
        hasher.update(read_small(fd, start + stored_slice.data_offset + nbytes, tail))
        _check_checksum(hasher, stored_slice, path, what)
        if not direct:
            for item in items:
                planner.resolve_tensor(item).detach().copy_(_narrow(dest, item.storage_offsets, item.lengths))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return os.path.isdir(checkpoint_id)


def verify_slices(checkpoint_dir: str, slices: list[tuple[str, StoredSlice]]) -> None:
    """Read every slice back and check its length and checksum (CorruptCheckpointError naming
    the file and item at fault)."""
    by_file: dict[str, list[tuple[str, StoredSlice]]] = {}
    for what, stored in slices:
        by_file.setdefault(stored.file, []).append((what, stored))
    with StreamIO() as stream_io:
        for relative_path, entries in sorted(by_file.items()):
            path, fd = _open_checkpoint_file(checkpoint_dir, relative_path)
            try:
                for what, stored in sorted(entries, key=lambda e: e[1].offset):
                    _check_length(path, fd, stored, what)
                    hasher = new_hasher(stored.checksum.algorithm)
                    hash_range(stream_io, fd, stored.offset, stored.length, hasher)
                    _check_checksum(hasher, stored, path, what)
            finally:
                os.close(fd)


def plan_box_reads(
    dest: str, fqn: str, offset: tuple[int, ...], shape: tuple[int, ...], stored: StoredTensor
) -> list[ReadItem]:
    """Read items that fill the box ``offset``/``shape`` of global tensor ``fqn`` (clipped to the
    stored global shape) into the target ``dest`` from the stored chunks that overlap it."""
    items = []
    for chunk in stored.chunks:
        lo = [max(a, b) for a, b in zip(offset, chunk.global_offset, strict=True)]
        hi = [
            min(a + s, b + t) for a, s, b, t in zip(offset, shape, chunk.global_offset, chunk.local_shape, strict=True)
        ]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(dest),
                dest_offsets=torch.Size(low - o for low, o in zip(lo, offset, strict=True)),
                storage_index=MetadataIndex(fqn, torch.Size(chunk.global_offset)),
                storage_offsets=torch.Size(low - c for low, c in zip(lo, chunk.global_offset, strict=True)),
                lengths=torch.Size(h - low for low, h in zip(lo, hi, strict=True)),
            )
        )
    return items


def _failure_summary(exc: CheckpointException) -> tuple[str, BaseException | None]:
    failures = exc.failures
    parts, first = [], None
    for rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        first = first or error
        parts.append(f"rank {rank}: {type(error).__name__}: {error}")
    return "; ".join(parts), first


def write_pieces(checkpoint_dir: str, pieces: list[PieceWrite], process_group) -> dict[PieceIndex, StoredSlice]:
    """Collectively write every rank's pieces into ``checkpoint_dir`` with DCP; return where
    this rank's pieces landed. A failure on any rank raises CheckpointIOError on every rank."""
    writer = HashingFileSystemWriter(checkpoint_dir)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                {},
                storage_writer=writer,
                planner=_PieceSavePlanner(pieces),
                process_group=process_group,
                no_dist=not dist_utils.is_distributed(),
            )
    except CheckpointException as exc:
        summary, _ = _failure_summary(exc)
        raise CheckpointIOError(f"writing {checkpoint_dir} failed: {summary}") from None
    return writer.written


def read_pieces(
    checkpoint_dir: str, items: list[ReadItem], targets: dict[str, torch.Tensor], pieces: dict[PieceIndex, StoredPiece]
) -> None:
    """Run ``items`` on this rank alone (no collectives), filling ``targets`` in place."""
    if not items:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(
                {},
                storage_reader=VerifiedReader(checkpoint_dir, pieces),
                planner=_PieceLoadPlanner(items, targets),
                no_dist=True,
            )
        except CheckpointException as exc:
            summary, first = _failure_summary(exc)
            if isinstance(first, (CheckpointingError, CorruptCheckpointError)):
                raise first from None
            raise CheckpointIOError(f"reading {checkpoint_dir} failed: {summary}") from None
