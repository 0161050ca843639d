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
  group at once (the products read each matrix with a row stride), and the mask of the last tile.
  Masked keys past the piece read the request's key 0 instead of their own slot, so a stale NaN in
  a block tail can never reach ``0 * NaN`` (as the reference zeroes such values); their
  probability is exactly 0. A layer makes three data movements for all groups at once: one gather
  of every group's keys and values, one ``take`` of every group's queries in the products' layout
  (rows of the query axis), one ``index_copy_`` of every result to its token's row (element
  indices made by the step's first layer); the per-group work is the two products and the masked
  softmax between them.

Batch invariance of the torch path: in both products the varying sizes of a step (the number of
requests, of queries per request) are the batch and the rows (the queries' axis), and a query's
key count is fixed by its position (padded to the end of its tile); each output element is a dot
product over the head dimension or over the keys in a fixed order, the same whatever else is in
the step, whether its query came in a decode step or a prefill chunk
(tests/unit_tests/inference/contexts/test_step_attention.py checks it bitwise). Masked keys get
probability exactly 0 against finite values, so they add exactly 0.
"""

from __future__ import annotations

import math
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
    writes into them instead of allocating (and page-faulting) megabytes per layer and step."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        # Views handed out this step (every layer of a step asks for the same ones).
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def start_step(self) -> None:
        """Forget the views of the previous step (the buffers stay)."""
        self._views.clear()

    def get(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A contiguous fp32 tensor of ``shape`` over buffer ``name`` (its values are stale)."""
        view = self._views.get((name, shape))
        if view is not None and view.device == device:
            return view
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=torch.float32, device=device)
            self._views = {key: v for key, v in self._views.items() if key[0] != name}
        view = self._views[(name, shape)] = buffer[:numel].view(shape)
        return view


@dataclass(frozen=True)
class _Layout:
    """Where every group's operands lie in a layer's shared buffers, for one (query heads, head
    dim): group ``i`` takes gathered rows ``[row_starts[i], row_starts[i + 1])`` and query elements
    ``[element_starts[i], element_starts[i + 1])``, in the products' layout ``[n * kv_heads, rows,
    d]``, its ``L * group`` rows zero-padded to a multiple of :data:`PRODUCT_ROW_MULTIPLE`."""

    # [E]: the element of the scaled queries ``[T, q_heads, d]`` (then one zero, which padding rows
    # take) each product row element takes, and the element of the results ``[T + 1, q_heads, d]``
    # it goes to (a padding query or padding row: the scratch row T).
    query_elements: torch.Tensor
    out_elements: torch.Tensor
    row_starts: list[int]
    element_starts: list[int]


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
        self._workspace.start_step()
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
        space = self._workspace
        padded_tokens, q_heads = query.shape[:2]
        layout = self._layout(q_heads, head_dim)
        device = query.device
        # The scaled queries, then one zero: the products' padding rows take it (see _Layout).
        scaled = space.get("scaled_queries", (query.numel() + 1,), device)
        torch.mul(query.float(), scale, out=scaled[:-1].view(query.shape))
        scaled[-1] = 0.0
        if rows.dtype == torch.float32:
            gathered = space.get("gathered", (self._kv_rows.numel(), rows.shape[1]), device)
            torch.index_select(rows, 0, self._kv_rows, out=gathered)
        else:
            gathered = rows.index_select(0, self._kv_rows).float()
        queries = space.get("query_rows", (layout.query_elements.numel(),), device)
        torch.take(scaled, layout.query_elements, out=queries)
        context = space.get("context_rows", (layout.query_elements.numel(),), device)
        for index, group in enumerate(self._groups):
            elements = slice(layout.element_starts[index], layout.element_starts[index + 1])
            _attend_group(
                group,
                gathered[layout.row_starts[index] : layout.row_starts[index + 1]],
                queries[elements],
                context[elements],
                q_heads,
                space,
            )
        # Every token's row gets its results; the padding tokens' rows are zero, and one scratch
        # row past them takes the results of padding queries.
        results = torch.empty(padded_tokens + 1, q_heads, head_dim, dtype=torch.float32, device=device)
        results[count:].zero_()
        results.view(-1).index_copy_(0, layout.out_elements, context)
        return results[:-1].to(query.dtype)

    def _layout(self, q_heads: int, head_dim: int) -> _Layout:
        """The groups' element indices for queries of ``q_heads`` heads of ``head_dim`` (see
        :class:`_Layout`), made by the first layer of the step."""
        key = (q_heads, head_dim)
        if key not in self._layouts:
            query_elements, out_elements, row_starts, element_starts = [], [], [0], [0]
            width = q_heads * head_dim
            # The zero after the scaled queries, and the first element of the results' scratch row.
            zero = scratch = self._step.num_padded_tokens * width
            for group in self._groups:
                n, length, kv_heads = group.num_requests, group.num_queries, group.kv_heads
                group_size = q_heads // kv_heads
                rows = length * group_size
                padding = -(-rows // PRODUCT_ROW_MULTIPLE) * PRODUCT_ROW_MULTIPLE - rows
                # [n, kv_heads, L, group, d]: piece r's query l, head (h, m), channel i
                heads = np.arange(q_heads).reshape(1, kv_heads, 1, group_size, 1)
                within = heads * head_dim + np.arange(head_dim).reshape(1, 1, 1, 1, head_dim)
                for packed, elements, pad in (
                    (group.query_rows, query_elements, zero),
                    (group.out_rows, out_elements, scratch + np.arange(head_dim)),
                ):
                    real = (packed.reshape(n, 1, length, 1, 1) * width + within).reshape(n * kv_heads, rows, head_dim)
                    padded = np.empty((n * kv_heads, rows + padding, head_dim), dtype=real.dtype)
                    padded[:, :rows], padded[:, rows:] = real, pad
                    elements.append(padded.reshape(-1))
                row_starts.append(row_starts[-1] + group.kv_rows.numel())
                element_starts.append(element_starts[-1] + n * kv_heads * (rows + padding) * head_dim)
            device = self._groups[0].kv_rows.device
            query_index, out_index = (
                torch.from_numpy(np.concatenate(e)).to(device) for e in (query_elements, out_elements)
            )
            self._layouts[key] = _Layout(query_index, out_index, row_starts, element_starts)
        return self._layouts[key]


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


def _attend_group(
    group: _Group,
    gathered: torch.Tensor,
    queries: torch.Tensor,
    context: torch.Tensor,
    q_heads: int,
    space: AttentionWorkspace,
) -> None:
    """The group's attention: from its ``gathered [2 * K * n, kv_heads * d]`` keys then values (of
    ``group.kv_rows``) and its scaled ``queries`` as the products' rows ``[n * kv_heads, rows, d]``
    (flat; ``L * group`` rows zero-padded to a multiple of :data:`PRODUCT_ROW_MULTIPLE`, see the
    constant), write the weighted values ``context`` in the same layout (fp32); temporaries live
    in ``space``."""
    n, num_keys = group.num_requests, group.num_keys
    kv_heads = group.kv_heads
    head_dim = gathered.shape[-1] // kv_heads
    length = group.num_queries
    group_size = q_heads // kv_heads
    batch, rows, device = n * kv_heads, length * group_size, gathered.device
    padded = queries.numel() // (batch * head_dim)
    # Keys and values of every head, key-major: the products' batch is (piece, KV head), each
    # matrix [K, d] read with a row stride of n * kv_heads * d.
    keys, values = gathered.view(2, num_keys, batch, head_dim).transpose(1, 2)
    q = queries.view(batch, padded, head_dim)
    scores = torch.bmm(q, keys.transpose(1, 2), out=space.get("scores", (batch, padded, num_keys), device))
    # Only the last key tile holds keys a query may not see (padding rows: zero queries, finite).
    hidden_from = group.hidden_from
    last_tile = scores[:, :rows].view(n, kv_heads, length, group_size, num_keys)[..., hidden_from:]
    last_tile.masked_fill_(group.hidden, float("-inf"))
    probs = space.get("probs", (batch, padded, num_keys), device)
    torch.ops.aten._softmax.out(scores, -1, False, out=probs)
    torch.bmm(probs, values, out=context.view(batch, padded, head_dim))
