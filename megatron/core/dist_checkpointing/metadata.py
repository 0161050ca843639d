"""Our description of a published checkpoint, stored as ``metadata.json`` next to DCP's files.

DCP's own ``.metadata`` (a pickle) is kept so that torch tooling opens the directory, but we
never read it: loading plans from this JSON, which also carries a CRC32 of every stored item so
truncated or corrupted files are caught.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from megatron.core.dist_checkpointing.errors import CheckpointingError, CorruptCheckpointError

METADATA_FILENAME = "metadata.json"
FORMAT_NAME = "megatron-dist-checkpoint"
FORMAT_VERSION = 1
COMMON_STATE_KEY = "__common__"


@dataclass(frozen=True)
class StoredSlice:
    """Where one DCP item's bytes live: a file of the checkpoint, a byte range, its CRC32."""

    file: str
    offset: int
    length: int
    crc32: int


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


def _chunk_json(chunk: StoredChunk) -> dict:
    return {"global_offset": list(chunk.global_offset), "local_shape": list(chunk.local_shape), **asdict(chunk.slice)}


def _chunk_from_json(entry: dict) -> StoredChunk:
    stored = StoredSlice(entry["file"], int(entry["offset"]), int(entry["length"]), int(entry["crc32"]))
    return StoredChunk(tuple(entry["global_offset"]), tuple(entry["local_shape"]), stored)


@dataclass
class CheckpointMetadata:
    """Every stored tensor (by key), object grid (by key) and the common state of a checkpoint."""

    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    objects: dict[str, StoredObjectGrid] = field(default_factory=dict)
    common: StoredChunk | None = None

    def to_json(self) -> str:
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
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> CheckpointMetadata:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT_NAME or raw.get("version") != FORMAT_VERSION:
                raise CorruptCheckpointError(
                    f"{where} is not a {FORMAT_NAME} version {FORMAT_VERSION} metadata file "
                    f"(format {raw.get('format')!r}, version {raw.get('version')!r})"
                )
            tensors = {
                key: StoredTensor(t["dtype"], tuple(t["global_shape"]), [_chunk_from_json(c) for c in t["chunks"]])
                for key, t in raw["tensors"].items()
            }
            objects = {
                key: StoredObjectGrid(
                    tuple(o["global_shape"]), {tuple(c["cell"]): _chunk_from_json(c) for c in o["cells"]}
                )
                for key, o in raw["objects"].items()
            }
            common = _chunk_from_json(raw["common"]) if raw["common"] else None
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(f"{where} is malformed: {type(err).__name__}: {err}") from err
        return cls(tensors, objects, common)


def read_metadata(checkpoint_dir: str) -> CheckpointMetadata:
    """Parse ``checkpoint_dir/metadata.json``; a missing file means an incomplete checkpoint."""
    path = os.path.join(checkpoint_dir, METADATA_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointingError(
            f"{checkpoint_dir} is not a complete checkpoint: {METADATA_FILENAME} is missing "
            "(only directories published by dist_checkpointing.save can be loaded)"
        )
    with open(path, encoding="utf-8") as f:
        return CheckpointMetadata.from_json(f.read(), path)
