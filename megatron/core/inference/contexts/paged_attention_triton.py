"""Fused Triton paged attention: the CUDA counterpart of
:func:`~megatron.core.inference.contexts.paged_attention.torch_paged_attention`, same arguments
and result.

One program per (query token, query head). It walks the token's request's blocks in a fixed
order (block by block through the block table, whole blocks) with an fp32 online softmax, so a
token's result depends only on its own request's keys, never on the rest of the step (batch
invariance, as the reference). Keys past the token's causal position are masked with ``-inf``
and their values replaced by 0 before any arithmetic, so NaN left in an unused block tail never
reaches the output (``0 * NaN`` would). Grouped-query attention: query head ``h`` reads KV head
``h // (q_heads // kv_heads)``.

Under ``TRITON_INTERPRET=1`` (set before this module is imported, when the kernel is decorated)
it also runs on CPU tensors, which is how the unit tests check it without a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megatron.core.inference.contexts.paged_attention import (
    check_inputs,
    token_requests_and_positions,
)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    table_ptr,
    request_ptr,
    position_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tr,
    group: tl.constexpr,
    block_size: tl.constexpr,
    head_dim: tl.constexpr,
    SLOTS: tl.constexpr,
    DIM: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    request = tl.load(request_ptr + token)
    position = tl.load(position_ptr + token)

    dims = tl.arange(0, DIM)
    dim_ok = dims < head_dim
    slots = tl.arange(0, SLOTS)
    slot_ok = slots < block_size
    q = tl.load(query_ptr + token * stride_qt + head * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)

    running_max = tl.full([], -float("inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([DIM], dtype=tl.float32)
    for block_index in range(position // block_size + 1):
        block = tl.load(table_ptr + request * stride_tr + block_index).to(tl.int64)
        visible = slot_ok & (block_index * block_size + slots <= position)
        tile_ok = slot_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            key_ptr + block * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=tile_ok,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            value_ptr + block * stride_vb + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=tile_ok,
            other=0.0,
        ).to(tl.float32)
        v = tl.where(visible[:, None], v, 0.0)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(visible, scores, -float("inf"))
        # The first block always holds key 0, visible to every token: the max is finite from here on.
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=0)
        acc = acc * correction + tl.sum(probs[:, None] * v, axis=0)
        running_max = new_max
    result = acc / running_sum
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, result.to(out_ptr.dtype.element_ty), mask=dim_ok)


def triton_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of packed queries over their requests' paged keys and values (fused kernel).

    Arguments and result as
    :func:`~megatron.core.inference.contexts.paged_attention.torch_paged_attention`: ``query
    [tokens, q_heads, head_dim]``, caches ``[blocks, block_size, kv_heads, head_dim]``,
    ``block_tables [requests, max_blocks]``, ``query_lengths, kv_lengths [requests]``; returns
    ``[tokens, q_heads, head_dim]`` in the dtype of ``query``.
    """
    num_tokens, _, head_dim = query.shape
    check_inputs(query, key_cache, query_lengths, kv_lengths)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    request_of, positions = token_requests_and_positions(query_lengths, kv_lengths)
    launch_paged_attention(out, query, key_cache, value_cache, block_tables, request_of, positions, scale)
    return out


def launch_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_requests: torch.Tensor,
    token_positions: torch.Tensor,
    scale: float,
) -> None:
    """Write the attention of ``query [tokens, q_heads, d]`` into ``out`` (same shape), given each
    token's request row (into ``block_tables``) and position: no check and nothing read back, so
    a step can call it with its precomputed metadata (and a CUDA graph can capture it)."""
    num_tokens, q_heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    # The kernel indexes the innermost (head_dim) axis with unit stride.
    query, key_cache, value_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (query, key_cache, value_cache)
    )
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    _paged_attention_kernel[(num_tokens, q_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        token_requests,
        token_positions,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        group=q_heads // kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        SLOTS=triton.next_power_of_2(block_size),
        DIM=triton.next_power_of_2(head_dim),
    )
