"""Writing and reading sharded pieces through torch.distributed.checkpoint (DCP).

Save: every piece a rank writes becomes a DCP ``SHARD`` write item of the global tensor named
by its key, with its global offset and shape as chunk metadata. DCP's ``FileSystemWriter``
stores the bytes and its coordinator writes the ``.metadata`` that torch's own tooling
(``format_utils.dcp_to_torch_save``, ``dcp.load`` with a plain state dict) understands.
The writer below also records a CRC32 of every item it wrote.

Load: a planner turns each requested box into DCP read items against the stored chunks
(resharding to any layout); the reader below reads only byte ranges named in our JSON
metadata, checks their length and CRC32, and decodes them with
``torch.load(weights_only=True)``. DCP's pickled ``.metadata`` is never read.
"""

from __future__ import annotations

import io
import os
import warnings
import zlib
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
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
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from megatron.core.dist_checkpointing import dist_utils
from megatron.core.dist_checkpointing.errors import CheckpointingError, CheckpointIOError, CorruptCheckpointError
from megatron.core.dist_checkpointing.metadata import StoredSlice, StoredTensor

PieceIndex = tuple[str, tuple[int, ...]]  # (DCP fqn, global offset)


@dataclass
class PieceWrite:
    """One piece this rank writes: ``tensor`` at ``global_offset`` of the global tensor ``fqn``."""

    fqn: str
    tensor: torch.Tensor
    global_offset: tuple[int, ...]
    global_shape: tuple[int, ...]


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
        return self._pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor.detach()


def _crc32_of_file_range(stream, offset: int, length: int) -> int:
    stream.seek(offset)
    crc, remaining = 0, length
    while remaining:
        block = stream.read(min(remaining, 64 << 20))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        remaining -= len(block)
    return crc


class ChecksummingFileSystemWriter(FileSystemWriter):
    """DCP's file writer that afterwards records a CRC32 of every item this rank wrote
    (``self.written``: piece index -> StoredSlice)."""

    def __init__(self, path: str, thread_count: int = 1):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count, overwrite=True)
        self.written: dict[PieceIndex, StoredSlice] = {}

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        by_file: dict[str, list] = {}
        for result in results:
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        for relative_path, file_results in by_file.items():
            with open(os.path.join(self.path, relative_path), "rb") as stream:
                for result in file_results:
                    info = result.storage_data
                    crc = _crc32_of_file_range(stream, info.offset, info.length)
                    self.written[(result.index.fqn, tuple(result.index.offset))] = StoredSlice(
                        relative_path, info.offset, info.length, crc
                    )
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


class VerifiedReader(StorageReader):
    """Reads the byte ranges our JSON metadata names, checking length and CRC32 first."""

    def __init__(self, checkpoint_dir: str, slices: dict[PieceIndex, StoredSlice]):
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        self._slices = slices

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

    def _read_verified(self, stream, path: str, fqn: str, stored: StoredSlice) -> bytes:
        stream.seek(stored.offset)
        raw = stream.read(stored.length)
        if len(raw) != stored.length:
            raise CorruptCheckpointError(
                f"{path} is truncated: item {fqn!r} needs {stored.length} bytes at offset {stored.offset}, "
                f"found {len(raw)}"
            )
        crc = zlib.crc32(raw)
        if crc != stored.crc32:
            raise CorruptCheckpointError(
                f"{path} is corrupted: item {fqn!r} ({stored.length} bytes at offset {stored.offset}) has CRC32 "
                f"{crc:08x}, the checkpoint recorded {stored.crc32:08x}"
            )
        return raw

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        by_piece: dict[PieceIndex, list[ReadItem]] = {}
        for item in plan.items:
            by_piece.setdefault((item.storage_index.fqn, tuple(item.storage_index.offset)), []).append(item)
        by_file: dict[str, list[PieceIndex]] = {}
        for piece in by_piece:
            by_file.setdefault(self._slices[piece].file, []).append(piece)
        for relative_path, pieces in sorted(by_file.items()):
            path = os.path.join(self.checkpoint_dir, relative_path)
            try:
                stream = open(path, "rb")
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path} is missing from the checkpoint") from None
            with stream:
                for piece in sorted(pieces, key=lambda p: self._slices[p].offset):
                    raw = self._read_verified(stream, path, piece[0], self._slices[piece])
                    stored = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    for item in by_piece[piece]:
                        source = _narrow(stored, item.storage_offsets, item.lengths)
                        target = planner.resolve_tensor(item).detach()
                        target.copy_(source)
                        planner.commit_tensor(item, target)
        future: Future = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return os.path.isdir(checkpoint_id)


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


def write_pieces(
    checkpoint_dir: str, pieces: list[PieceWrite], process_group, thread_count: int = 1
) -> dict[PieceIndex, StoredSlice]:
    """Collectively write every rank's pieces into ``checkpoint_dir`` with DCP; return where
    this rank's pieces landed. A failure on any rank raises CheckpointIOError on every rank."""
    writer = ChecksummingFileSystemWriter(checkpoint_dir, thread_count=thread_count)
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
    checkpoint_dir: str, items: list[ReadItem], targets: dict[str, torch.Tensor], slices: dict[PieceIndex, StoredSlice]
) -> None:
    """Run ``items`` on this rank alone (no collectives), filling ``targets`` in place."""
    if not items:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(
                {},
                storage_reader=VerifiedReader(checkpoint_dir, slices),
                planner=_PieceLoadPlanner(items, targets),
                no_dist=True,
            )
        except CheckpointException as exc:
            summary, first = _failure_summary(exc)
            if isinstance(first, (CheckpointingError, CorruptCheckpointError)):
                raise first from None
            raise CheckpointIOError(f"reading {checkpoint_dir} failed: {summary}") from None
