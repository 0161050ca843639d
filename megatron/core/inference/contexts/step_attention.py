"""The paged attention of one step, planned once for all of its layers.

:meth:`StepAttention.plan` reads the step's requests (query lengths, cached lengths, block
tables) once; :meth:`StepAttention.attend` then serves every attention layer of the step. The
backend comes from :func:`~megatron.core.inference.contexts.paged_attention.resolve_backend`:

- **triton**: the fused kernel of :mod:`paged_attention_triton` through
  :func:`~paged_attention.paged_attention` without host-side checks (the step's lengths are
  consistent by construction), so a call never waits for the device and a CUDA graph can
  capture it.
- **torch** (the CPU path): each layer gathers keys and values and computes scores and weighted
  values as batched matrix products per (piece, KV head): ``S = Q @ K^T`` (``[queries, d] @ [d,
  keys]``, keys innermost, as softmax reads them) and ``O = P @ V``. A *piece* is a request's
  queries that end in the same key tile (a decode request is one piece; a prefill chunk is cut at
  :data:`~paged_attention.KEY_TILE` boundaries), so it sees every key before its last tile and
  needs no key past it: a piece's keys are padded with masked keys to the end of that tile, and
  only that tile is masked. Pieces are grouped by kind (one query, or several: padded to the
  group's longest) and key count. The plan (once per step, on the host) holds per group one index
  of cache slots, key-major, whose ``index_select`` gives the keys and values of every head of the
  group at once (the products read each matrix with a row stride), and which keys of the last tile
  each query may not see; the step's first layer turns these into an additive mask (``-inf`` there,
  0 elsewhere) that the score product adds on its way out (``baddbmm``), so no layer makes a
  masking pass of its own.
  Masked keys past the piece read the request's key 0 instead of their own slot, so a stale NaN in
  a block tail can never reach ``0 * NaN`` (as the reference zeroes such values); their
  probability is exactly 0. A layer makes three data movements for all groups at once, each an
  ``index_select`` of rows of ``d`` elements: one gather of every group's keys and values, one of
  every group's queries in the products' layout (rows of the query axis; padding rows take a zero
  row), one of every (token, head)'s result from the products' rows (padding tokens take a zero
  row); the per-group work is the two products and the softmax between them. The step's
  first layer makes the row indices and every group's operand views over buffers kept across
  steps (:class:`AttentionWorkspace`), which the later layers reuse as they are.

Batch invariance of the torch path: in both products the varying sizes of a step (the number of
requests, of queries per request) are the batch and the rows (the queries' axis), and a query's
key count is fixed by its position (padded to the end of its tile); each output element is a dot
product over the head dimension or over the keys in a fixed order, the same whatever else is in
the step, whether its query came in a decode step or a prefill chunk
(tests/unit_tests/inference/contexts/test_step_attention.py checks it bitwise). The mask adds
exactly 0 to a visible key's score, and masked keys get probability exactly 0 against finite
values, so they add exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core.inference.contexts.paged_attention import KEY_TILE, paged_attention, resolve_backend

# The products' rows (queries times the heads of a GQA group) are zero-padded to a multiple of
# this. BLAS may compute a GEMM with few rows by another kernel, whose sums round differently: MKL
# (AVX2 and AVX-512 dispatch alike) does below 4 rows, and for a lone matrix (a batch of one) on
# several threads also at 5-7 and 9-11, so a decode query's 2 rows (a GQA group) and the same
# query among a prefill chunk's 128 would not give the same bits. Every row of a product whose row
# count is a multiple of 4 comes out the same whatever the count, the batch and the thread count.
PRODUCT_ROW_MULTIPLE = 4


@dataclass(frozen=True)
class _Group:
    """Pieces attended together by the torch path: ``n`` pieces of at most ``L`` queries over
    ``K`` (padded) keys. Index tensors are on the device; masks are kept inverted (what
    ``masked_fill_`` takes). Built once per step, used by every layer."""

    # [2 * K * n]: the row (of PagedKVCache.slots_from) of each (key, piece)'s keys, then of its
    # values; one gather gives the keys and values of every head.
    kv_rows: torch.Tensor
    hidden: torch.Tensor  # [n, 1, L, 1, KEY_TILE] query i of piece r does not see key hidden_from + j
    hidden_from: int  # K - KEY_TILE: every query of the group sees every key before its last tile
    # [n * L] (host): the packed row each (request, query) reads its query from (a padding query
    # repeats a row of its request) and writes its result to (a padding query: the scratch row
    # past the step).
    query_rows: np.ndarray
    out_rows: np.ndarray
    kv_heads: int
    num_requests: int  # n (pieces)
    num_keys: int  # K
    num_queries: int  # L


class AttentionWorkspace:
    """Grow-only fp32 buffers for the temporaries of the torch path (gathered keys and values,
    queries, scores, probabilities, weighted values), kept by the context across steps: a layer
    writes into them instead of allocating (and page-faulting) megabytes per layer and step. A
    buffer that must grow at least doubles, so that a decode run whose keys grow by a tile now
    and then reallocates (and faults in fresh pages) a few times, not at every growth."""

    def __init__(self):
        self._buffers: dict[Hashable, torch.Tensor] = {}

    def buffer(self, name: Hashable, numel: int, device: torch.device) -> torch.Tensor:
        """The first ``numel`` elements (contiguous, stale values) of fp32 buffer ``name``."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            grown = 2 * buffer.numel() if buffer is not None and buffer.device == device else 0
            buffer = self._buffers[name] = torch.empty(max(numel, grown), dtype=torch.float32, device=device)
        return buffer[:numel]


@dataclass(frozen=True)
class _GroupOperands:
    """One group's operands in a layer, views of the step's buffers (the same for every layer)."""

    queries: torch.Tensor  # [n * kv_heads, rows, d]: rows zero-padded to a multiple of PRODUCT_ROW_MULTIPLE
    keys: torch.Tensor  # [n * kv_heads, d, K] (of the gathered keys, read with a row stride)
    values: torch.Tensor  # [n * kv_heads, K, d]
    scores: torch.Tensor  # [n * kv_heads, rows, K]
    mask: torch.Tensor  # scores' shape: -inf where a query may not see a key, else 0 (padding rows: 0)
    probs: torch.Tensor  # [n * kv_heads, rows, K]
    context: torch.Tensor  # [n * kv_heads, rows, d]


@dataclass(frozen=True)
class _Layout:
    """Where every group's operands lie in a layer's buffers, for one (query heads, head dim),
    made by the step's first layer and used by every layer: the products' rows of all groups lie
    one after another in ``query_rows`` and ``context_rows`` (rows of ``d``), each group's ``L *
    group`` rows zero-padded to a multiple of :data:`PRODUCT_ROW_MULTIPLE`."""

    scaled: torch.Tensor  # [T, q_heads, d]: the scaled queries, rows of scaled_rows (a zero row after)
    scaled_rows: torch.Tensor  # [T * q_heads + 1, d]
    # [rows]: the row of scaled_rows each product row takes (a padding row: the zero row).
    query_index: torch.Tensor
    query_rows: torch.Tensor  # [rows, d]
    context_rows: torch.Tensor  # [rows + 1, d]: every group's weighted values, then a zero row
    # [T * q_heads]: the row of context_rows each (token, head) takes (padding tokens: the zero row).
    out_index: torch.Tensor
    gathered: torch.Tensor  # [2 * sum(K * n), kv_heads * d]: every group's keys, then its values
    groups: list[_GroupOperands]


class StepAttention:
    """Paged attention over the step's requests (see module doc). Build with :meth:`plan`."""

    def __init__(
        self,
        backend: str,
        scale: float | None,
        groups: list[_Group],
        step,
        kv_heads: int,
        workspace: AttentionWorkspace | None = None,
    ):
        self.backend = backend
        self.kv_heads = kv_heads
        self.scale = scale
        self._groups = groups
        self._step = step
        self._workspace = workspace if workspace is not None else AttentionWorkspace()
        self._kv_rows = torch.cat([group.kv_rows for group in groups]) if groups else None
        self._layouts: dict[tuple[int, int], _Layout] = {}

    @classmethod
    def plan(
        cls,
        step,
        host_block_tables: torch.Tensor,
        block_size: int,
        device: torch.device,
        softmax_scale: float | None = None,
        *,
        kv_heads: int,
        value_slot_offset: int,
        workspace: AttentionWorkspace | None = None,
    ) -> StepAttention:
        """Plan the attention of ``step`` (a :class:`~dynamic_context.StepBatch`) whose request rows
        use ``host_block_tables [rows, max_blocks]`` (CPU; padding requests included) over a
        :class:`~kv_cache.PagedKVCache` of ``kv_heads`` KV heads whose values lie
        ``value_slot_offset`` rows after the keys (:meth:`~kv_cache.PagedKVCache.slots_from`);
        ``workspace``: the caller's buffers for the layers' temporaries (default: fresh ones)."""
        backend = resolve_backend("auto", device)
        groups = []
        if backend == "torch" and step.num_tokens:
            # A request's queries in pieces by the key tile they end in: a query sees keys up to its
            # own position only, so each piece gathers and scores only the key tiles it needs.
            pieces = []  # (block-table row, queries, tokens cached before them, first packed row)
            start = 0
            for row, (length, offset) in enumerate(zip(step.host_query_lengths, step.host_kv_offsets, strict=True)):
                end = offset + length
                first = offset
                while first < end:
                    last = min((first // KEY_TILE + 1) * KEY_TILE, end)
                    pieces.append((row, last - first, first, start + first - offset))
                    first = last
                start += length
            # One group per (one query or several, padded key count).
            buckets: dict[tuple[bool, int], list[int]] = {}
            for index, (_, length, offset, _) in enumerate(pieces):
                buckets.setdefault((length > 1, -(-(offset + length) // KEY_TILE)), []).append(index)
            plan = _PiecePlan(pieces, host_block_tables, block_size, step.num_padded_tokens)
            for (_, tiles), members in sorted(buckets.items()):
                groups.append(plan.group(members, tiles * KEY_TILE, kv_heads, value_slot_offset, device))
        return cls(backend, softmax_scale, groups, step, kv_heads, workspace)

    def attend(self, query: torch.Tensor, kv_cache, layer_index: int) -> torch.Tensor:
        """Attention ``[T, q_heads, d]`` of the step's packed ``query [T, q_heads, d]`` over local layer
        ``layer_index`` of ``kv_cache`` (a :class:`~kv_cache.PagedKVCache`, this step's K/V stored);
        rows past the step's ``num_tokens`` (padding tokens) are zero."""
        step = self._step
        head_dim = query.shape[-1]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)
        count = step.num_tokens
        if not count:
            return torch.zeros_like(query)
        if self.backend == "triton":
            # The lengths are read on the device; rows past them (padding) come back zero.
            key_cache, value_cache = kv_cache.layer(layer_index)
            return paged_attention(
                query,
                key_cache,
                value_cache,
                step.block_tables,
                step.query_lengths,
                step.kv_lengths,
                scale,
                backend="triton",
                validate=False,  # build_step made the lengths consistent; checking reads them on the host
            )
        cache_heads = kv_cache.data.shape[-2]
        if cache_heads != self.kv_heads:
            raise ValueError(f"the step was planned for {self.kv_heads} KV heads, the cache has {cache_heads}")
        rows = kv_cache.slots_from(layer_index)  # [*, kv_heads * d]: keys at slot, values further
        q_heads = query.shape[1]
        layout = self._layouts.get((q_heads, head_dim)) or self._layout(q_heads, head_dim, query.device)
        torch.mul(query.float(), scale, out=layout.scaled)
        if rows.dtype == torch.float32:
            torch.index_select(rows, 0, self._kv_rows, out=layout.gathered)
        else:
            layout.gathered.copy_(rows.index_select(0, self._kv_rows))
        torch.index_select(layout.scaled_rows, 0, layout.query_index, out=layout.query_rows)
        for group in layout.groups:
            _attend_group(group)
        # Every token's row takes its results; the padding tokens' rows take the zero row.
        results = layout.context_rows.index_select(0, layout.out_index)
        return results.view(query.shape).to(query.dtype)

    def _layout(self, q_heads: int, head_dim: int, device: torch.device) -> _Layout:
        """The groups' operands for queries of ``q_heads`` heads of ``head_dim`` (see
        :class:`_Layout`), made by the first layer of the step."""
        space, key = self._workspace, (q_heads, head_dim)
        padded_tokens = self._step.num_padded_tokens
        shapes, start = [], 0  # per group: (first product row, batch, padded rows, rows)
        for group in self._groups:
            rows = group.num_queries * (q_heads // group.kv_heads)
            padded = -(-rows // PRODUCT_ROW_MULTIPLE) * PRODUCT_ROW_MULTIPLE
            shapes.append((start, group.num_requests * group.kv_heads, padded, rows))
            start += shapes[-1][1] * padded
        # Per (token, head), its row of the products' results; the padding tokens' rows name the zero
        # row after them, and padding queries write the heads of one more token (scratch), cut off.
        out_index = np.full((padded_tokens + 1) * q_heads, start, dtype=np.int64)
        query_index = np.full(start, padded_tokens * q_heads, dtype=np.int64)  # padding rows: the zero row
        for group, (first, batch, padded, rows) in zip(self._groups, shapes, strict=True):
            n, length, kv_heads = group.num_requests, group.num_queries, group.kv_heads
            # [n, kv_heads, L, group]: piece r's query l, head (h, m)
            heads = np.arange(q_heads).reshape(kv_heads, 1, q_heads // kv_heads)
            product_rows = query_index[first : first + batch * padded].reshape(batch, padded)
            product_rows[:, :rows] = (group.query_rows.reshape(n, 1, length, 1) * q_heads + heads).reshape(batch, rows)
            results = np.arange(first, first + batch * padded).reshape(batch, padded)[:, :rows]
            tokens = group.out_rows.reshape(n, 1, length, 1) * q_heads + heads
            out_index[tokens] = results.reshape(tokens.shape)
        out_index = out_index[: padded_tokens * q_heads]

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        scaled_rows = space.buffer(("scaled_queries", key), (padded_tokens * q_heads + 1) * head_dim, device)
        scaled_rows = scaled_rows.view(-1, head_dim)
        scaled_rows[-1].zero_()
        query_rows = space.buffer(("query_rows", key), start * head_dim, device).view(start, head_dim)
        context_rows = space.buffer(("context_rows", key), (start + 1) * head_dim, device).view(start + 1, head_dim)
        context_rows[-1].zero_()
        width = self.kv_heads * head_dim
        gathered = space.buffer(("gathered", key), self._kv_rows.numel() * width, device).view(-1, width)
        sizes = [
            batch * padded * group.num_keys for group, (_, batch, padded, _) in zip(self._groups, shapes, strict=True)
        ]
        scores_buffer, probs_buffer = (space.buffer((name, key), max(sizes), device) for name in ("scores", "probs"))
        masks = space.buffer(("masks", key), sum(sizes), device).zero_()
        operands, kv_start, mask_start = [], 0, 0
        for group, (first, batch, padded, rows) in zip(self._groups, shapes, strict=True):
            n, num_keys, length = group.num_requests, group.num_keys, group.num_queries
            group_size = q_heads // group.kv_heads
            kv_end = kv_start + group.kv_rows.numel()
            # Keys and values of every head, key-major: the products' batch is (piece, KV head), each
            # matrix [K, d] read with a row stride of n * kv_heads * d.
            keys, values = gathered[kv_start:kv_end].view(2, num_keys, batch, head_dim).transpose(1, 2)
            kv_start = kv_end
            size = batch * padded * num_keys
            mask = masks[mask_start : mask_start + size].view(batch, padded, num_keys)
            mask_start += size
            # Only the last key tile holds keys a query may not see (padding rows: zero queries, finite).
            last_tile = mask[:, :rows].view(n, group.kv_heads, length, group_size, num_keys)[..., group.hidden_from :]
            last_tile.masked_fill_(group.hidden, float("-inf"))
            operands.append(
                _GroupOperands(
                    queries=query_rows[first : first + batch * padded].view(batch, padded, head_dim),
                    keys=keys.transpose(1, 2),
                    values=values,
                    scores=scores_buffer[:size].view(batch, padded, num_keys),
                    mask=mask,
                    probs=probs_buffer[:size].view(batch, padded, num_keys),
                    context=context_rows[first : first + batch * padded].view(batch, padded, head_dim),
                )
            )
        layout = self._layouts[key] = _Layout(
            scaled=scaled_rows[:-1].view(padded_tokens, q_heads, head_dim),
            scaled_rows=scaled_rows,
            query_index=tensor(query_index),
            query_rows=query_rows,
            context_rows=context_rows,
            out_index=tensor(out_index),
            gathered=gathered,
            groups=operands,
        )
        return layout


class _PiecePlan:
    """The host-side index math of every piece of a step at once (padded to the longest piece and
    the most keys), in NumPy (a step's few dozen small index operations cost a few microseconds
    each there, several times less than as tensors); :meth:`group` slices out one group's tensors."""

    def __init__(self, pieces, host_block_tables, block_size, scratch_row):
        rows, lengths, offsets, starts = np.array(pieces, dtype=np.int64).reshape(-1, 4).T
        self.max_queries = int(lengths.max())
        num_keys = -(-int((offsets + lengths).max()) // KEY_TILE) * KEY_TILE
        self.key_pos = np.arange(num_keys)
        tables = host_block_tables.numpy()[rows]
        columns = np.minimum(self.key_pos // block_size, tables.shape[1] - 1)
        slots = tables[:, columns] * block_size + self.key_pos % block_size  # [P, K]
        # Keys past a piece's last query (all in its last tile; past the request's cached length, or
        # this step's keys it does not see) read the request's key 0 instead: whatever stale bytes
        # their own slots hold (a NaN would poison 0 * NaN), the gathered values stay the request's
        # own finite ones, and their probability is exactly 0, so they add exactly 0.
        self.slots = np.where(self.key_pos >= (offsets + lengths)[:, None], slots[:, :1], slots)
        query_index = np.arange(self.max_queries)
        real = query_index < lengths[:, None]  # [P, L]
        # A padding query (past a shorter piece) takes position 0 (finite; its result goes to the scratch row).
        self.positions = np.where(real, offsets[:, None] + query_index, 0)
        self.query_rows = starts[:, None] + np.minimum(query_index, lengths[:, None] - 1)
        self.out_rows = np.where(real, self.query_rows, scratch_row)
        self.lengths = lengths

    def group(self, members, num_keys, kv_heads, value_slot_offset, device) -> _Group:
        """The group of pieces ``members`` (indices), over ``num_keys`` keys."""
        index = np.array(members, dtype=np.int64)
        queries = int(self.lengths[index].max())
        slots = self.slots[index, :num_keys].T.reshape(-1)  # key-major [K * n]
        # Every query of a piece lies in its last key tile, so it sees every key before that tile.
        hidden_from = num_keys - KEY_TILE
        positions = self.positions[index, :queries]
        hidden = self.key_pos[hidden_from:num_keys] > positions[:, :, None]  # [n, L, KEY_TILE]

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return _Group(
            kv_rows=tensor(np.concatenate([slots, slots + value_slot_offset])),
            # [n, 1, L, 1, KEY_TILE]: the scores' (piece, KV head, query, member, key)
            hidden=tensor(hidden[:, None, :, None]),
            hidden_from=hidden_from,
            query_rows=self.query_rows[index, :queries].reshape(-1),
            out_rows=self.out_rows[index, :queries].reshape(-1),
            kv_heads=kv_heads,
            num_requests=len(members),
            num_keys=num_keys,
            num_queries=queries,
        )


def _attend_group(group: _GroupOperands) -> None:
    """The group's attention, in its operands (see :class:`_GroupOperands`): masked scores (the
    product plus the mask, in one call), probabilities and weighted values (fp32)."""
    torch.baddbmm(group.mask, group.queries, group.keys, out=group.scores)
    torch.ops.aten._softmax.out(group.scores, -1, False, out=group.probs)
    torch.bmm(group.probs, group.values, out=group.context)
