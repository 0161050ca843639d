"""Checksums of checkpoint bytes.

Format 2 checkpoints record an XXH3-64 of every stored item and file (``xxhash``: about ten
times the speed of CRC32 and it releases the GIL, so hashing overlaps file I/O on another
thread); format 1 checkpoints recorded CRC32s, which are still verified when they are read.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import xxhash

WRITTEN_ALGORITHM = "xxh3_64"


class _Crc32:
    def __init__(self):
        self._value = 0

    def update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


_HASHERS = {"xxh3_64": xxhash.xxh3_64, "crc32": _Crc32}
_HEX_DIGITS = {"xxh3_64": 16, "crc32": 8}


def new_hasher(algorithm: str = WRITTEN_ALGORITHM):
    """An incremental hasher (``update(bytes-like)``, ``intdigest()``) of ``algorithm``."""
    return _HASHERS[algorithm]()


@dataclass(frozen=True)
class Checksum:
    """A checksum value and the algorithm that produced it."""

    algorithm: str
    value: int

    def __post_init__(self):
        if self.algorithm not in _HASHERS:
            raise ValueError(f"unknown checksum algorithm {self.algorithm!r}; known: {sorted(_HASHERS)}")

    @classmethod
    def of(cls, hasher, algorithm: str = WRITTEN_ALGORITHM) -> Checksum:
        return cls(algorithm, hasher.intdigest())

    def __str__(self) -> str:
        return f"{self.algorithm.upper()} {self.value:0{_HEX_DIGITS[self.algorithm]}x}"
