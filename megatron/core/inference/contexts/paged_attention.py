"""Attention over a paged KV cache, in plain torch (the CPU reference path).

Like GPU paged-attention kernels, it reads WHOLE blocks through each request's block table
and masks by length: key ``j`` of a request is visible to its query ``i`` when
``j <= kv_offset + i`` (causal within the request's new tokens, everything cached before).
Value rows past the request's length are masked as well as scores, so stale bytes in an
unused block tail cannot leak into this reference; faster kernels may multiply them by a
zero weight (0 * NaN = NaN), which is why the context zeroes every fresh private page.
Grouped-query attention: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.

Batch invariance: a query's result is bitwise the same whatever else is in the step and however
its request's tokens were split into steps (prefill chunk, decode token, recompute after
eviction), so pausing, eviction and chunking never change outputs. The products are reduced
elementwise (no matmul whose blocking depends on the number of queries), and the key axis is
padded with masked keys to a multiple of :data:`KEY_TILE`, which keeps softmax on one kernel
path for every key count.
"""

from __future__ import annotations

import math

import torch

KEY_TILE = 64


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of packed queries over their requests' paged keys and values.

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
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if int(query_lengths.sum()) != num_tokens:
        raise ValueError(f"query_lengths sum to {int(query_lengths.sum())} but query has {num_tokens} tokens")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = q_heads // kv_heads
    out = torch.empty_like(query)
    start = 0
    for row, (q_len, kv_len) in enumerate(zip(query_lengths.tolist(), kv_lengths.tolist())):
        if q_len > kv_len:
            raise ValueError(f"request {row}: {q_len} new tokens but only {kv_len} tokens in the cache")
        num_blocks = math.ceil(kv_len / block_size)
        blocks = block_tables[row, :num_blocks]
        num_keys = math.ceil(num_blocks * block_size / KEY_TILE) * KEY_TILE
        keys = query.new_zeros(num_keys, kv_heads, head_dim, dtype=torch.float32)
        values = torch.zeros_like(keys)
        keys[:kv_len] = key_cache[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        values[:kv_len] = value_cache[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        key_pos = torch.arange(num_keys, device=query.device)
        query_pos = kv_len - q_len + torch.arange(q_len, device=query.device)
        visible = key_pos[None, :] <= query_pos[:, None]  # [q, k]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        q = query[start:start + q_len].float()
        scores = (q[:, None] * keys[None]).sum(-1) * scale  # [q, k, h]
        scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
        probs = torch.softmax(scores.transpose(1, 2), dim=-1).transpose(1, 2)  # [q, k, h]
        out[start:start + q_len] = (probs[..., None] * values[None]).sum(1).to(query.dtype)
        start += q_len
    return out
