"""Attention over a paged KV cache, in plain torch (the CPU reference path).

Like GPU paged-attention kernels, it reads WHOLE blocks through each request's block table
and masks by length: key ``j`` of a request is visible to its query ``i`` when
``j <= kv_offset + i`` (causal within the request's new tokens, everything cached before).
Value rows past a query's position are masked as well as scores, so stale bytes in an unused
block tail cannot leak into this reference; faster kernels may multiply them by a zero weight
(0 * NaN = NaN), which is why the context zeroes every fresh private page.
Grouped-query attention: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.

All queries of a step are computed together, each over its own request's keys gathered
through the block table (``[queries, keys, heads, dim]``, in slices of :data:`QUERY_SLICE`
queries to bound memory).

Batch invariance: a query's result is bitwise the same whatever else is in the step and however
its request's tokens were split into steps (prefill chunk, decode token, recompute after
eviction), so pausing, eviction and chunking never change outputs. The products are reduced
elementwise per query (no matmul whose blocking depends on the number of queries), and the key
axis is padded with masked keys to a multiple of :data:`KEY_TILE`, which keeps softmax on one
kernel path for every key count.

Backends: :func:`paged_attention` runs the fused Triton kernel of
:mod:`~megatron.core.inference.contexts.paged_attention_triton` when the tensors are on CUDA and
Triton imports, else this torch reference. ``backend="torch"|"triton"`` (or the environment
variable :data:`BACKEND_ENV`) forces one.
"""

from __future__ import annotations

import math
import os

import torch

from megatron.core.errors import MegatronConfigError
from megatron.core.triton_support import triton_importable

KEY_TILE = 64
QUERY_SLICE = 128
BACKEND_ENV = "MEGATRON_PAGED_ATTENTION_BACKEND"
BACKENDS = ("auto", "torch", "triton")


class PagedAttentionBackendError(MegatronConfigError):
    """An unknown paged-attention backend was asked for, or the Triton one without Triton."""


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``: an explicit ``backend`` wins, then
    the :data:`BACKEND_ENV` variable, then auto (Triton on CUDA when it imports)."""
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if backend not in BACKENDS:
        raise PagedAttentionBackendError(
            f"paged attention backend {backend!r} is unknown; accepted: {BACKENDS} (argument or {BACKEND_ENV})"
        )
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if backend == "triton" and not triton_importable():
        raise PagedAttentionBackendError(
            "paged attention backend 'triton' was forced but triton does not import; "
            "install triton or use backend 'torch'"
        )
    return backend


def check_inputs(
    query: torch.Tensor, key_cache: torch.Tensor, query_lengths: torch.Tensor, kv_lengths: torch.Tensor
) -> None:
    """Raise ValueError when heads do not group, or lengths do not fit the packed queries."""
    q_heads, kv_heads = query.shape[1], key_cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if int(query_lengths.sum()) != query.shape[0]:
        raise ValueError(f"query_lengths sum to {int(query_lengths.sum())} but query has {query.shape[0]} tokens")
    bad = (query_lengths > kv_lengths).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(
            f"request {row}: {int(query_lengths[row])} new tokens but only {int(kv_lengths[row])} tokens in the cache"
        )


def token_requests_and_positions(
    query_lengths: torch.Tensor, kv_lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed query token: its request row and its position (keys ``0..position`` visible)."""
    device = query_lengths.device
    request_of = torch.repeat_interleave(torch.arange(len(query_lengths), device=device), query_lengths)
    first = torch.cumsum(query_lengths, 0) - query_lengths
    token_index = torch.arange(request_of.numel(), device=device)
    positions = (kv_lengths - query_lengths)[request_of] + token_index - first[request_of]
    return request_of, positions


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    softmax_scale: float | None = None,
    backend: str = "auto",
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Attention of packed queries over their requests' paged keys and values, on the backend
    :func:`resolve_backend` picks (``backend``: ``"auto"``, ``"torch"`` or ``"triton"``).
    Arguments and result as :func:`torch_paged_attention`; ``validate=False`` skips the Triton
    path's length checks, which read the lengths on the host (the torch path reads them anyway)."""
    if resolve_backend(backend, query.device) == "triton":
        from megatron.core.inference.contexts.paged_attention_triton import (
            triton_paged_attention,
        )

        return triton_paged_attention(
            query, key_cache, value_cache, block_tables, query_lengths, kv_lengths, softmax_scale, validate=validate
        )
    return torch_paged_attention(query, key_cache, value_cache, block_tables, query_lengths, kv_lengths, softmax_scale)


def torch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of packed queries over their requests' paged keys and values (torch reference).

    Args:
        query: ``[tokens, q_heads, head_dim]``, the requests' new tokens packed in batch order
            (a prefill chunk or one decode token each; padding tokens excluded).
        key_cache, value_cache: ``[blocks, block_size, kv_heads, head_dim]`` of one layer, this
            step's K/V already stored.
        block_tables: ``[requests, max_blocks]`` block ids per request (entries past a
            request's last block are ignored).
        query_lengths: ``[requests]`` new tokens per request (sum = ``tokens``).
        kv_lengths: ``[requests]`` tokens in the cache per request, this step's included.
    Returns:
        ``[tokens, q_heads, head_dim]`` in the dtype of ``query``.
    """
    num_tokens, q_heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    check_inputs(query, key_cache, query_lengths, kv_lengths)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    device = query.device
    request_of, positions = token_requests_and_positions(query_lengths, kv_lengths)
    flat_keys = key_cache.reshape(-1, kv_heads, head_dim)
    flat_values = value_cache.reshape(-1, kv_heads, head_dim)
    group = q_heads // kv_heads
    for lo in range(0, num_tokens, QUERY_SLICE):
        hi = min(lo + QUERY_SLICE, num_tokens)
        num_keys = math.ceil((int(positions[lo:hi].max()) + 1) / KEY_TILE) * KEY_TILE
        key_pos = torch.arange(num_keys, device=device)
        table_col = (key_pos // block_size).clamp(max=block_tables.shape[1] - 1)
        slots = block_tables[request_of[lo:hi]][:, table_col] * block_size + key_pos % block_size  # [q, k]
        visible = (key_pos[None, :] <= positions[lo:hi, None])[:, :, None, None]  # [q, k, 1, 1]
        keys = flat_keys[slots].float()  # [q, k, kv_heads, d]; masked scores below
        values = torch.where(visible, flat_values[slots].float(), 0.0)
        q = query[lo:hi].float().reshape(hi - lo, 1, kv_heads, group, head_dim)
        scores = (q * keys[:, :, :, None, :]).sum(-1) * scale  # [q, k, kv_heads, group]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.permute(0, 2, 3, 1), dim=-1).permute(0, 3, 1, 2)
        context = (probs[..., None] * values[:, :, :, None, :]).sum(1)  # [q, kv_heads, group, d]
        out[lo:hi] = context.reshape(hi - lo, q_heads, head_dim).to(query.dtype)
    return out
