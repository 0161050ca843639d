"""Our description of a published checkpoint, stored as ``metadata.json`` next to DCP's files.

DCP's own ``.metadata`` (a pickle) is kept so that torch tooling opens the directory, but we
never read it: loading plans from this JSON, which also carries a checksum of every stored item
(and of every other file published with the checkpoint) so truncated or corrupted files are
caught.

Format 2 (written now) records per item an XXH3-64 and ``data_offset``, where the raw tensor
bytes start inside the item (see ``strategies.torch_dcp``), and lists the checkpoint's other
files (``model_config.json``, the tokenizer's) with their lengths and checksums. Format 1
checkpoints (CRC32 per item, no data offsets, no file list) are still read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from megatron.core.dist_checkpointing.checksums import WRITTEN_ALGORITHM, Checksum
from megatron.core.dist_checkpointing.errors import CheckpointingError, CorruptCheckpointError

METADATA_FILENAME = "metadata.json"
FORMAT_NAME = "megatron-dist-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
COMMON_STATE_KEY = "__common__"


@dataclass(frozen=True)
class StoredSlice:
    """Where one DCP item's bytes live: a file of the checkpoint, a byte range and its checksum.
    ``data_offset`` (format 2): the raw tensor bytes start that many bytes into the item; None
    (format 1): the item must be decoded with ``torch.load``."""

    file: str
    offset: int
    length: int
    checksum: Checksum
    data_offset: int | None = None


@dataclass(frozen=True)
class StoredFile:
    """A file published with the checkpoint (path relative to it), its length and checksum."""

    length: int
    checksum: Checksum


@dataclass
class StoredChunk:
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    slice: StoredSlice


@dataclass
class StoredTensor:
    dtype: str
    global_shape: tuple[int, ...]
    chunks: list[StoredChunk] = field(default_factory=list)


@dataclass
class StoredObjectGrid:
    """The cells of a ShardedObject grid. Each cell is stored as a 1-D uint8 tensor of its
    encoded bytes (see ``object_codec``), one chunk at offset 0."""

    global_shape: tuple[int, ...]
    cells: dict[tuple[int, ...], StoredChunk] = field(default_factory=dict)


def _checksum_json(checksum: Checksum) -> dict:
    return {checksum.algorithm: f"{checksum.value:x}"}


def _checksum_from_json(entry: dict, version: int) -> Checksum:
    if version == 1:
        return Checksum("crc32", int(entry["crc32"]))
    return Checksum(WRITTEN_ALGORITHM, int(entry[WRITTEN_ALGORITHM], 16))


def _chunk_json(chunk: StoredChunk) -> dict:
    stored = chunk.slice
    return {
        "global_offset": list(chunk.global_offset),
        "local_shape": list(chunk.local_shape),
        "file": stored.file,
        "offset": stored.offset,
        "length": stored.length,
        "data_offset": stored.data_offset,
        **_checksum_json(stored.checksum),
    }


def _chunk_from_json(entry: dict, version: int) -> StoredChunk:
    data_offset = None if version == 1 else int(entry["data_offset"])
    stored = StoredSlice(
        entry["file"], int(entry["offset"]), int(entry["length"]), _checksum_from_json(entry, version), data_offset
    )
    return StoredChunk(tuple(entry["global_offset"]), tuple(entry["local_shape"]), stored)


@dataclass
class CheckpointMetadata:
    """Every stored tensor (by key), object grid (by key), the common state and the other
    files of a checkpoint."""

    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    objects: dict[str, StoredObjectGrid] = field(default_factory=dict)
    common: StoredChunk | None = None
    files: dict[str, StoredFile] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def slices(self) -> list[tuple[str, StoredSlice]]:
        """``(what, slice)`` of every stored item (``what`` names it in error messages)."""
        out = [(f"tensor {key!r}", c.slice) for key, t in self.tensors.items() for c in t.chunks]
        out += [(f"object {key!r}", c.slice) for key, grid in self.objects.items() for c in grid.cells.values()]
        if self.common is not None:
            out.append(("the common state", self.common.slice))
        return out

    def to_json(self) -> str:
        if self.version != FORMAT_VERSION:
            raise CheckpointingError(f"only format version {FORMAT_VERSION} is written, not {self.version}")
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "tensors": {
                    key: {
                        "dtype": t.dtype,
                        "global_shape": list(t.global_shape),
                        "chunks": [_chunk_json(c) for c in t.chunks],
                    }
                    for key, t in sorted(self.tensors.items())
                },
                "objects": {
                    key: {
                        "global_shape": list(o.global_shape),
                        "cells": [{"cell": list(cell), **_chunk_json(c)} for cell, c in sorted(o.cells.items())],
                    }
                    for key, o in sorted(self.objects.items())
                },
                "common": _chunk_json(self.common) if self.common else None,
                "files": {
                    name: {"length": f.length, **_checksum_json(f.checksum)} for name, f in sorted(self.files.items())
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> CheckpointMetadata:
        try:
            raw = json.loads(text)
            version = raw.get("version")
            if raw.get("format") != FORMAT_NAME or version not in READABLE_VERSIONS:
                raise CorruptCheckpointError(
                    f"{where} is not a {FORMAT_NAME} metadata file of a readable version {READABLE_VERSIONS} "
                    f"(format {raw.get('format')!r}, version {version!r})"
                )
            tensors = {
                key: StoredTensor(
                    t["dtype"], tuple(t["global_shape"]), [_chunk_from_json(c, version) for c in t["chunks"]]
                )
                for key, t in raw["tensors"].items()
            }
            objects = {
                key: StoredObjectGrid(
                    tuple(o["global_shape"]), {tuple(c["cell"]): _chunk_from_json(c, version) for c in o["cells"]}
                )
                for key, o in raw["objects"].items()
            }
            common = _chunk_from_json(raw["common"], version) if raw["common"] else None
            files = {
                name: StoredFile(int(f["length"]), _checksum_from_json(f, version))
                for name, f in raw.get("files", {}).items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(f"{where} is malformed: {type(err).__name__}: {err}") from err
        return cls(tensors, objects, common, files, version)


def read_text(path: str) -> str:
    """The UTF-8 text of the checkpoint file ``path``; CorruptCheckpointError naming the file
    and the first bad byte when it is not valid UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorruptCheckpointError(
            f"{path} is not valid UTF-8: byte {data[err.start]:#04x} at offset {err.start} ({err.reason})"
        ) from None


def read_json(path: str):
    """The JSON value of the checkpoint file ``path``; CorruptCheckpointError naming the file,
    the line and column when it does not parse (e.g. a truncated file)."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CorruptCheckpointError(
            f"{path} is not valid JSON ({len(text.encode())} bytes): {err.msg} at line {err.lineno} column {err.colno}"
        ) from None


def read_metadata(checkpoint_dir: str) -> CheckpointMetadata:
    """Parse ``checkpoint_dir/metadata.json``; a missing file means an incomplete checkpoint."""
    path = os.path.join(checkpoint_dir, METADATA_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointingError(
            f"{checkpoint_dir} is not a complete checkpoint: {METADATA_FILENAME} is missing "
            "(only directories published by dist_checkpointing.save can be loaded)"
        )
    return CheckpointMetadata.from_json(read_text(path), path)
