"""Chained hashes of full KV blocks, the keys of the prefix cache.

The hash of block ``i`` covers the hash of block ``i - 1`` and the tokens of block ``i``, so
equal hashes mean equal whole prefixes (up to a 64-bit collision). Hashes use BLAKE2b over
the token ids, never Python's ``hash``: every pipeline stage and every process must derive
the same keys. Only full blocks are hashed; a partial tail block has no hash until it fills.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # the "previous hash" of a request's first block


def hash_block(prev_hash: int, tokens: Sequence[int]) -> int:
    """64-bit chained hash of one full block: ``H(prev_hash, tokens)``."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<Q", prev_hash))
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(digest.digest(), "little")


class BlockHashChain:
    """The chained hashes of one request's full blocks, computed once and kept.

    :meth:`extend` hashes only the blocks that became full since the last call, so a request
    that is paused, evicted and re-admitted (its chain handed back to
    :meth:`DynamicInferenceContext.add_request`) is never rehashed.
    """

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hashes: list[int] = []

    @property
    def num_hashed_tokens(self) -> int:
        return len(self.hashes) * self.block_size

    def extend(self, tokens: Sequence[int]) -> list[int]:
        """Hash the newly full blocks of ``tokens`` (the request's whole token list so far,
        starting with the tokens already hashed); return the new hashes."""
        if len(tokens) < self.num_hashed_tokens:
            raise ValueError(
                f"token list of length {len(tokens)} is shorter than the {self.num_hashed_tokens} "
                f"tokens this chain already hashed; pass the request's whole token list"
            )
        new = []
        prev = self.hashes[-1] if self.hashes else ROOT_HASH
        for start in range(self.num_hashed_tokens, len(tokens) - self.block_size + 1, self.block_size):
            prev = hash_block(prev, tokens[start : start + self.block_size])
            new.append(prev)
        self.hashes.extend(new)
        return new
