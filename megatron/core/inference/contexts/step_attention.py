"""The paged attention of one step, planned once for all of its layers.

:meth:`StepAttention.plan` reads the step's requests (query lengths, cached lengths, block
tables) once; :meth:`StepAttention.attend` then serves every attention layer of the step. The
backend comes from :func:`~megatron.core.inference.contexts.paged_attention.resolve_backend`:

- **triton**: the fused kernel of :mod:`paged_attention_triton` through
  :func:`~paged_attention.paged_attention` without host-side checks (the step's lengths are
  consistent by construction), so a call never waits for the device and a CUDA graph can
  capture it.
- **torch** (the CPU path): the plan computes, for every request, the cache slots of its keys
  (padded with masked keys to a multiple of :data:`~paged_attention.KEY_TILE`) and the causal
  mask of its queries once; each layer then gathers the keys and values and computes scores
  and weighted values as batched matrix products per
  (request, KV head): ``S = K @ Q^T`` (``[keys, d] @ [d, queries]``) and ``O^T = V^T @ P^T``,
  values past a request's cached length zeroed first (so a stale NaN cannot leak, as in the
  reference).
  Requests are grouped by kind (decode: one query each; prefill chunks: queries padded to the
  longest chunk) and padded key count, so a request gathers only its own key tiles. The plan
  holds one row index per group (cache row of each (KV head, request, key)), so each layer
  gathers its keys and values straight into the products' layout with one ``index_select``
  each; where every key before the last tile is visible (decode), only that tile is masked.

Batch invariance of the torch path: in both products the varying sizes of a step (the number of
requests, of queries per request, of padded keys) are the batch, the queries' axis and a
zero-padded end of the reduction; each output element is a dot product over the head dimension
or over the keys in a fixed order, the same whatever else is in the step, whether its query came
in a decode step or a prefill chunk (tests/unit_tests/inference/contexts/test_step_attention.py
checks it bitwise). Masked keys get probability exactly 0 against finite values, so they add
exactly 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.core.inference.contexts.paged_attention import KEY_TILE, paged_attention, resolve_backend


@dataclass(frozen=True)
class _Group:
    """Requests attended together by the torch path: ``n`` requests of at most ``L`` queries over
    ``K`` (padded) keys."""

    # [kv_heads * n * K]: row ``slot * kv_heads + head`` of each (head, request, key) in a layer's
    # cache viewed as [slots * kv_heads, d]; one gather gives the keys (values) of every head.
    head_rows: torch.Tensor
    kv_heads: int
    num_requests: int  # n
    num_keys: int  # K
    # Masks are kept inverted (what masked_fill takes), once per step rather than per layer.
    # Every request of a group has keys in its last tile, so only that tile holds unstored keys.
    unstored: torch.Tensor  # [1, n, KEY_TILE, 1] key K - KEY_TILE + j of request r is not in its cache
    hidden: torch.Tensor  # [1, n, L, 1, K - hidden_from] query i of request r does not see key hidden_from + j
    hidden_from: int  # keys before it are seen by every query (decode: all but the last tile)
    query_rows: torch.Tensor  # [n * L] packed row of each (request, query); padding queries repeat a row
    valid: torch.Tensor | None  # [n * L] which (request, query) pairs are real (None: all)
    out_rows: torch.Tensor  # [real queries] packed row each real (request, query) pair writes
    num_queries: int  # L


class StepAttention:
    """Paged attention over the step's requests (see module doc). Build with :meth:`plan`."""

    def __init__(self, backend: str, scale: float | None, groups: list[_Group], step, kv_heads: int):
        self.backend = backend
        self.kv_heads = kv_heads
        self.scale = scale
        self._groups = groups
        self._step = step

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
    ) -> StepAttention:
        """Plan the attention of ``step`` (a :class:`~dynamic_context.StepBatch`) whose request rows
        use ``host_block_tables [rows, max_blocks]`` (CPU; padding requests included) over caches
        of ``kv_heads`` KV heads."""
        backend = resolve_backend("auto", device)
        groups = []
        if backend == "torch" and step.num_tokens:
            lengths = step.host_query_lengths
            offsets = step.host_kv_offsets
            starts = [0]
            for length in lengths[:-1]:
                starts.append(starts[-1] + length)
            # One group per (decode or prefill, padded key count): a request gathers only its own
            # key tiles, never those of the longest request in the step.
            buckets: dict[tuple[bool, int], list[int]] = {}
            for row, length in enumerate(lengths):
                buckets.setdefault((length > 1, -(-(offsets[row] + length) // KEY_TILE)), []).append(row)
            for _, rows in sorted(buckets.items()):
                groups.append(
                    _plan_group(rows, lengths, offsets, starts, host_block_tables, block_size, kv_heads, device)
                )
        return cls(backend, softmax_scale, groups, step, kv_heads)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        """Attention ``[T, q_heads, d]`` of the step's packed ``query [T, q_heads, d]`` over one layer's
        caches ``[blocks, block_size, kv_heads, d]`` (this step's K/V stored); rows past the
        step's ``num_tokens`` (padding tokens) are zero."""
        step = self._step
        head_dim = query.shape[-1]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)
        out = torch.zeros_like(query)
        count = step.num_tokens
        if not count:
            return out
        if self.backend == "triton":
            out[:count] = paged_attention(
                query[:count],
                key_cache,
                value_cache,
                step.block_tables,
                step.query_lengths,
                step.kv_lengths,
                scale,
                backend="triton",
                validate=False,  # build_step made the lengths consistent; checking reads them on the host
            )
            return out
        if key_cache.shape[2] != self.kv_heads:
            raise ValueError(f"the step was planned for {self.kv_heads} KV heads, the cache has {key_cache.shape[2]}")
        flat_keys = key_cache.reshape(-1, head_dim)  # [cache slots * kv_heads, d]
        flat_values = value_cache.reshape(-1, head_dim)
        scaled = query.float() * scale
        for group in self._groups:
            result = _attend_group(group, scaled, flat_keys, flat_values)
            out.index_copy_(0, group.out_rows, result.to(out.dtype))
        return out


def _plan_group(rows, lengths, offsets, starts, host_block_tables, block_size, kv_heads, device) -> _Group:
    queries = max(lengths[r] for r in rows)
    rows_t = torch.tensor(rows, dtype=torch.long)
    length_t = torch.tensor([lengths[r] for r in rows], dtype=torch.long)
    offset_t = torch.tensor([offsets[r] for r in rows], dtype=torch.long)
    start_t = torch.tensor([starts[r] for r in rows], dtype=torch.long)
    # Sizes from the host lists: reading them from the tensors would be a host read per group.
    num_keys = math.ceil(max(offsets[r] + lengths[r] for r in rows) / KEY_TILE) * KEY_TILE
    key_pos = torch.arange(num_keys)
    tables = host_block_tables.index_select(0, rows_t)
    columns = (key_pos // block_size).clamp(max=tables.shape[1] - 1)
    slots = tables[:, columns] * block_size + key_pos % block_size  # [n, K]
    query_index = torch.arange(queries)
    real = query_index[None, :] < length_t[:, None]  # [n, L]
    # A padding query sees key 0 only (finite; its result is dropped).
    positions = torch.where(real, offset_t[:, None] + query_index[None, :], 0)
    visible = key_pos[None, None, :] <= positions[:, :, None]  # [n, L, K]
    query_rows = (start_t[:, None] + torch.minimum(query_index[None, :], length_t[:, None] - 1)).reshape(-1)
    valid = real.reshape(-1)
    all_real = all(lengths[r] == queries for r in rows)
    out_rows = query_rows if all_real else query_rows[valid]
    stored = key_pos[None, -KEY_TILE:] < (offset_t + length_t)[:, None]
    hidden_from = num_keys - KEY_TILE if queries == 1 else 0
    head_rows = slots[None] * kv_heads + torch.arange(kv_heads)[:, None, None]  # [kv_heads, n, K]
    return _Group(
        head_rows=head_rows.reshape(-1).to(device),
        kv_heads=kv_heads,
        num_requests=len(rows),
        num_keys=num_keys,
        unstored=(~stored)[None, :, :, None].to(device),
        hidden=(~visible)[None, :, :, None, hidden_from:].to(device),
        hidden_from=hidden_from,
        query_rows=query_rows.to(device),
        valid=None if all_real else valid.to(device),
        out_rows=out_rows.to(device),
        num_queries=queries,
    )


def _attend_group(group: _Group, query: torch.Tensor, flat_keys: torch.Tensor, flat_values: torch.Tensor):
    """The group's attention rows ``[real queries, q_heads, d]`` (fp32)."""
    head_dim = flat_keys.shape[1]
    n, num_keys = group.num_requests, group.num_keys
    kv_heads = group.kv_heads
    length = group.num_queries
    q_heads = query.shape[1]
    group_size = q_heads // kv_heads
    keys = flat_keys.index_select(0, group.head_rows).float().view(kv_heads * n, num_keys, head_dim)
    # Values past a request's cached length are zeroed (their probability is 0, but a stale NaN in
    # a block tail would still poison 0 * NaN); only the group's last key tile holds any.
    values = flat_values.index_select(0, group.head_rows).float().view(kv_heads, n, num_keys, head_dim)
    values[:, :, num_keys - KEY_TILE :].masked_fill_(group.unstored, 0.0)
    values = values.view(kv_heads * n, num_keys, head_dim)
    # Queries as [kv_heads * n, d, L * group]: the columns of S = K @ Q^T.
    q = query.index_select(0, group.query_rows).view(n, length, kv_heads, group_size, head_dim)
    q = q.permute(2, 0, 4, 1, 3).reshape(kv_heads * n, head_dim, length * group_size)
    scores = torch.bmm(keys, q).transpose(1, 2).view(kv_heads, n, length, group_size, num_keys)
    scores[..., group.hidden_from :].masked_fill_(group.hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kv_heads * n, length * group_size, num_keys)
    context = torch.bmm(values.transpose(1, 2), probs.transpose(1, 2))  # [kv_heads * n, d, L * group]
    context = context.view(kv_heads, n, head_dim, length, group_size).permute(1, 3, 0, 4, 2)
    context = context.reshape(n * length, q_heads, head_dim)
    return context if group.valid is None else context[group.valid]
