"""Megatron's indexed binary dataset: a ``.bin`` of token ids and an ``.idx`` describing it.

``PREFIX.bin`` holds the token ids of every sequence, concatenated, in one numpy dtype.
``PREFIX.idx`` (little-endian) holds:

    magic            9 bytes  b"MMIDIDX\\x00\\x00"
    version          uint64   1
    dtype code       uint8    see DTYPE_CODES
    sequence count   uint64   N
    document count   uint64   D + 1 (document indices start with 0)
    sequence_lengths int32[N]    tokens per sequence
    sequence_pointers int64[N]   byte offset of each sequence in the .bin
    document_indices int64[D+1]  sequence index where each document starts, then N

A document is one or more consecutive sequences (one per document unless sentences were
split). The reader memory-maps both files and checks the header against the file sizes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np

from megatron.core.errors import MegatronInputError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document count


class IndexedDatasetError(MegatronInputError):
    """A missing or malformed .bin/.idx pair, or a token that does not fit the dataset dtype."""


def data_file_path(path_prefix: str | os.PathLike) -> str:
    return f"{os.fspath(path_prefix)}.bin"


def index_file_path(path_prefix: str | os.PathLike) -> str:
    return f"{os.fspath(path_prefix)}.idx"


def optimal_dtype(vocab_size: int) -> type:
    """Smallest token dtype for ``vocab_size`` ids: uint16 up to 65536 ids, else int32."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    accepted = ", ".join(np.dtype(d).name for d in DTYPE_CODES.values())
    raise IndexedDatasetError(f"dtype {dtype.name} cannot be stored; accepted dtypes: {accepted}")


class IndexedDatasetBuilder:
    """Writes ``PREFIX.bin`` while sequences are added, then ``PREFIX.idx`` on :meth:`finalize`."""

    def __init__(self, bin_path: str | os.PathLike, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        self._dtype_code = _dtype_code(self.dtype)
        self._bin_path = os.fspath(bin_path)
        self._data_file = open(self._bin_path, "wb")
        self._sequence_lengths: list[int] = []
        self._document_indices: list[int] = [0]

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise IndexedDatasetError(f"a sequence must be 1-D, got shape {array.shape}")
        if array.size and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                raise IndexedDatasetError(
                    f"token ids span {low}..{high} but dtype {self.dtype.name} holds "
                    f"{info.min}..{info.max}; pick the dtype with optimal_dtype(vocab_size)"
                )
        self._data_file.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sequence_lengths.append(array.size)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """Append one document made of sequences of ``lengths`` tokens (one sequence if None)."""
        array = np.asarray(tokens)
        lengths = [array.size] if lengths is None else list(lengths)
        if sum(lengths) != array.size:
            raise IndexedDatasetError(f"sequence lengths {lengths} do not add up to the {array.size} tokens given")
        start = 0
        for length in lengths:
            self.add_item(array[start : start + length])
            start += length
        self.end_document()

    def close(self) -> None:
        """Close the .bin without writing an index (to abandon a build); safe to call twice."""
        self._data_file.close()

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Close the .bin and write the .idx."""
        self.close()
        if self._document_indices[-1] != len(self._sequence_lengths):
            self.end_document()  # sequences added after the last end_document form a document
        lengths = np.asarray(self._sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.asarray(self._document_indices, dtype=np.int64)
        with open(idx_path, "wb") as index_file:
            index_file.write(INDEX_MAGIC)
            index_file.write(_HEADER.pack(INDEX_VERSION, self._dtype_code, len(lengths), len(document_indices)))
            index_file.write(lengths.tobytes(order="C"))
            index_file.write(pointers.tobytes(order="C"))
            index_file.write(document_indices.tobytes(order="C"))


class IndexedDataset:
    """Memory-mapped reader of ``PREFIX.bin`` + ``PREFIX.idx``; item ``i`` is sequence ``i``."""

    def __init__(self, path_prefix: str | os.PathLike):
        self.path_prefix = os.fspath(path_prefix)
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path} not found: a dataset prefix PREFIX needs PREFIX.bin and PREFIX.idx "
                    "(written by tools/preprocess_data.py)"
                )
        self._read_index(idx_path)
        self._check_data(bin_path)
        total_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        # numpy cannot memory-map an empty file; an empty dataset has nothing to map.
        self._data = np.memmap(bin_path, dtype=self.dtype, mode="r") if total_tokens else np.empty(0, dtype=self.dtype)

    def _read_index(self, idx_path: str) -> None:
        index = np.memmap(idx_path, dtype=np.uint8, mode="r") if os.path.getsize(idx_path) else np.empty(0, np.uint8)
        header_size = len(INDEX_MAGIC) + _HEADER.size
        if index.size < header_size or bytes(index[: len(INDEX_MAGIC)]) != INDEX_MAGIC:
            raise IndexedDatasetError(
                f"{idx_path} is not a Megatron index file: expected it to start with magic {INDEX_MAGIC!r}"
            )
        version, dtype_code, sequence_count, document_count = _HEADER.unpack(
            bytes(index[len(INDEX_MAGIC) : header_size])
        )
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{idx_path} has index version {version}; accepted version: {INDEX_VERSION}")
        if dtype_code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path} has dtype code {dtype_code}; accepted codes: {sorted(DTYPE_CODES)}")
        expected_size = header_size + sequence_count * (4 + 8) + document_count * 8
        if index.size != expected_size:
            raise IndexedDatasetError(
                f"{idx_path} is {index.size} bytes but its header ({sequence_count} sequences, "
                f"{document_count} document indices) implies {expected_size}; the file is truncated or corrupt"
            )
        self.dtype = np.dtype(DTYPE_CODES[dtype_code])
        offset = header_size
        self.sequence_lengths = np.frombuffer(index, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, np.int64, document_count, offset)
        self._index_buffer = index
        doc = self.document_indices
        if doc.size == 0 or doc[0] != 0 or doc[-1] != sequence_count or np.any(np.diff(doc) < 0):
            raise IndexedDatasetError(
                f"{idx_path} has invalid document indices: they must start at 0, never decrease "
                f"and end at the sequence count {sequence_count}"
            )

    def _check_data(self, bin_path: str) -> None:
        itemsize = self.dtype.itemsize
        expected_pointers = np.zeros(len(self.sequence_lengths), dtype=np.int64)
        np.cumsum(self.sequence_lengths[:-1].astype(np.int64) * itemsize, out=expected_pointers[1:])
        if not np.array_equal(expected_pointers, self.sequence_pointers):
            raise IndexedDatasetError(
                f"{index_file_path(self.path_prefix)} has sequence pointers that do not match its "
                "sequence lengths; the index is corrupt"
            )
        expected_bytes = int(self.sequence_lengths.sum(dtype=np.int64)) * itemsize
        actual_bytes = os.path.getsize(bin_path)
        if actual_bytes != expected_bytes:
            raise IndexedDatasetError(
                f"{bin_path} is {actual_bytes} bytes but its index describes {expected_bytes} bytes "
                f"of {self.dtype.name}; the .bin and .idx do not belong together"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (a read-only view)."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence index {idx} out of range for {len(self)} sequences")
        idx %= len(self)
        sequence_length = int(self.sequence_lengths[idx])
        length = sequence_length - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens {offset}..{offset + length} requested from sequence {idx} of {sequence_length} tokens"
            )
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._data[start : start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def document_lengths(self) -> np.ndarray:
        """Tokens per document (the sum of its sequences' lengths), int64."""
        totals = np.concatenate(([0], np.cumsum(self.sequence_lengths, dtype=np.int64)))
        return totals[self.document_indices[1:]] - totals[self.document_indices[:-1]]

    @property
    def document_token_offsets(self) -> np.ndarray:
        """Token offset of each document's first token in the .bin, int64."""
        totals = np.concatenate(([0], np.cumsum(self.sequence_lengths, dtype=np.int64)))
        return totals[self.document_indices[:-1]]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` of the whole .bin (documents are stored back to back)."""
        return self._data[start:stop]

    def __getstate__(self):
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"])
