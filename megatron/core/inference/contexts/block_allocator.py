"""The KV block pool: the one owner of every block's lifecycle (allocate, share, free, cache,
evict).

Blocks ``0 .. num_blocks - 1`` are usable; block ``num_blocks`` is the reserved dummy block that
padding tokens write to and that is never handed out. Every usable block with a reference
count of zero sits in one doubly linked free list, which is also the eviction order:

* :meth:`BlockPool.allocate` pops from the head. A popped block that still carries a prefix
  cache hash is evicted from the cache at that moment.
* :meth:`BlockPool.free` releases a request's blocks leaf first: cached blocks go to the tail
  (least recently used is evicted first), uncached ones to the head (they hold nothing worth
  keeping, so they are reused before any cached block is evicted).
* :meth:`BlockPool.share` takes a reference on cached blocks; one that was free is unlinked.
* Blocks for an import (reason ``import``) are handed out as one run of consecutive ids when
  enough consecutive free blocks hold no cached prefix: a handoff transfer then moves each
  layer's K (V) of the run as one descriptor instead of one per block. Taking uncached free
  blocks out of order changes no eviction order (they hold nothing worth keeping).

Since a request always holds its whole chain and frees it leaf first, and a cache lookup
takes a contiguous prefix, a cached block always enters the free list after its cached
children: eviction takes leaves first, and a cached child implies cached ancestors (asserted
when a block is evicted).

Every block handed out fresh is a *private page*: :meth:`BlockPool.allocate` is the single
place that initializes it (through ``page_initializer``, which zeroes its K and V planes)
before anything is written to it, and counts it under the path (:class:`PageReason`) that
asked for it.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence

from megatron.core.inference.contexts.errors import BlockPoolExhaustedError, InferenceContextError


class PageReason(enum.StrEnum):
    """Why a fresh block is handed out. Every reason but ``IMPORT`` initializes the page."""

    ADMISSION = "admission"
    DECODE_GROWTH = "decode_growth"
    RESUME = "resume"
    ASYNC_PREPARATION = "async_preparation"
    LOOKAHEAD = "lookahead"
    HANDOFF_CONTINUATION = "handoff_continuation"
    # Imported blocks are overwritten whole by the KV transfer (the sender exports whole
    # blocks with finite tails); zeroing them could race with that write.
    IMPORT = "import"

    @property
    def initializes_page(self) -> bool:
        return self is not PageReason.IMPORT

    @property
    def prefers_contiguous(self) -> bool:
        """Imported blocks are written by a transfer, which moves a run of consecutive ids at once."""
        return self is PageReason.IMPORT


NO_BLOCK = -1


class BlockPool:
    """Reference-counted KV blocks with a prefix cache and an LRU free list (see module doc).

    Args:
        num_blocks: usable blocks; the dummy block gets id ``num_blocks``.
        page_initializer: called with the ids of blocks just handed out fresh for a reason that
            initializes pages (zeroes their K/V); None for a pool without storage (tests).
    """

    def __init__(self, num_blocks: int, page_initializer: Callable[[list[int]], None] | None = None):
        if num_blocks < 1:
            raise InferenceContextError(f"a block pool needs at least 1 usable block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.dummy_block_id = num_blocks
        self.page_initializer = page_initializer
        # Circular doubly linked list over the usable blocks, with its own sentinel node.
        self._sentinel = num_blocks + 1
        self._next = list(range(1, num_blocks + 2)) + [0]
        self._prev = [self._sentinel] + list(range(num_blocks + 1))
        self._next[num_blocks - 1] = self._sentinel
        self._prev[self._sentinel] = num_blocks - 1
        self._num_free = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._parents = [NO_BLOCK] * num_blocks
        self._num_cached_children = [0] * num_blocks
        self._cached: dict[int, int] = {}
        self.private_page_init_counts: Counter[str] = Counter()
        self.handed_out_counts: Counter[str] = Counter()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`allocate` can hand out (free, cached-but-unreferenced included)."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The prefix-cache hash a block is registered under, or None."""
        return self._hashes[block_id]

    def peek_free(self, count: int) -> list[int]:
        """The ids the next :meth:`allocate` of ``count`` blocks will hand out, in order (for a
        reason that does not prefer a contiguous run)."""
        ids, node = [], self._next[self._sentinel]
        while node != self._sentinel and len(ids) < count:
            ids.append(node)
            node = self._next[node]
        return ids

    def find_cached_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest prefix of ``block_hashes`` that is cached (no refs taken)."""
        ids = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    # ---- lifecycle -----------------------------------------------------------------------
    def allocate(self, count: int, reason: PageReason) -> list[int]:
        """Hand out ``count`` fresh private blocks (ref count 1) for ``reason``.

        Cached blocks taken from the free list are evicted from the prefix cache. For every
        reason but IMPORT the pages are initialized before they are returned. For IMPORT the
        ids are one ascending run when one exists among the uncached free blocks (see module
        doc). Raises BlockPoolExhaustedError, allocating nothing, when fewer than ``count`` are
        free.
        """
        reason = PageReason(reason)
        if count > self._num_free:
            raise BlockPoolExhaustedError(
                f"asked for {count} KV blocks ({reason.value}) but only {self._num_free} of "
                f"{self.num_blocks} are free; free or evict requests first"
            )
        run = self._uncached_free_run(count) if reason.prefers_contiguous and count > 1 else None
        ids = []
        for index in range(count):
            block_id = self._next[self._sentinel] if run is None else run + index
            self._unlink(block_id)
            if self._hashes[block_id] is not None:
                self._evict(block_id)
            assert self._ref_counts[block_id] == 0, f"block {block_id} in the free list is referenced"
            self._ref_counts[block_id] = 1
            ids.append(block_id)
        self.handed_out_counts[reason.value] += count
        if reason.initializes_page and ids:
            self.private_page_init_counts[reason.value] += count
            if self.page_initializer is not None:
                self.page_initializer(ids)
        return ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each cached block (a prefix cache hit); touching a free
        one unlinks it from the free list, so it is no longer an eviction candidate."""
        for block_id in block_ids:
            assert self._hashes[block_id] is not None, f"block {block_id} is not cached and cannot be shared"
            if self._ref_counts[block_id] == 0:
                self._unlink(block_id)
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a request's chain (given root first); blocks
        reaching zero go back to the free list, leaf first (see module doc)."""
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise InferenceContextError(f"block {block_id} freed more often than it was referenced")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hashes[block_id] is None:
                    self._link_after(self._sentinel, block_id)
                else:
                    self._link_after(self._prev[self._sentinel], block_id)

    def register(self, block_id: int, block_hash: int, parent_block_id: int = NO_BLOCK) -> bool:
        """Enter a block whose KV is now computed into the prefix cache under ``block_hash``.

        ``parent_block_id`` is the cached block holding the previous block of the chain (or
        NO_BLOCK for a first block). Returns False, registering nothing, when the hash is
        already cached under another block: two requests computed the same block in the same
        step, and only the first registers.
        """
        assert self._ref_counts[block_id] > 0, f"only a referenced block can be registered, not {block_id}"
        assert self._hashes[block_id] is None, f"block {block_id} is already registered"
        if block_hash in self._cached:
            return False
        if parent_block_id != NO_BLOCK:
            assert self._hashes[parent_block_id] is not None, "a cached block's parent must be cached"
            self._num_cached_children[parent_block_id] += 1
        self._cached[block_hash] = block_id
        self._hashes[block_id] = block_hash
        self._parents[block_id] = parent_block_id
        return True

    # ---- internals -----------------------------------------------------------------------
    def _uncached_free_run(self, count: int) -> int | None:
        """The first id of the lowest run of ``count`` consecutive free blocks without a hash,
        or None. The free list's head first (the common case, O(count)), else one scan of the
        pool."""
        head = self.peek_free(count)
        if head == list(range(head[0], head[0] + count)) and all(self._hashes[b] is None for b in head):
            return head[0]
        length = 0
        for block_id in range(self.num_blocks):
            length = length + 1 if self._ref_counts[block_id] == 0 and self._hashes[block_id] is None else 0
            if length == count:
                return block_id - count + 1
        return None

    def _evict(self, block_id: int) -> None:
        assert self._num_cached_children[block_id] == 0, (
            f"evicting block {block_id} would orphan its cached children (eviction must take leaves first)"
        )
        del self._cached[self._hashes[block_id]]
        parent = self._parents[block_id]
        if parent != NO_BLOCK:
            self._num_cached_children[parent] -= 1
        self._hashes[block_id] = None
        self._parents[block_id] = NO_BLOCK

    def _unlink(self, block_id: int) -> None:
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev], self._prev[nxt] = nxt, prev
        self._num_free -= 1

    def _link_after(self, anchor: int, block_id: int) -> None:
        nxt = self._next[anchor]
        self._next[anchor], self._prev[block_id] = block_id, anchor
        self._next[block_id], self._prev[nxt] = nxt, block_id
        self._num_free += 1
