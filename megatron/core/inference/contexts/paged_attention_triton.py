"""Fused Triton paged attention: the CUDA counterpart of
:func:`~megatron.core.inference.contexts.paged_attention.torch_paged_attention`, same arguments
and result, for decode, prefill and mixed steps in one launch.

Work split. One program per (query block, KV head, key split):

- a *query block* is up to ``TOKENS`` consecutive new tokens of one request times the ``group``
  query heads that share the KV head (grouped-query attention without repeating K/V: each K/V
  tile is read once for the whole group), ``ROWS = TOKENS * group_pad`` rows in all (at least 16,
  the tensor-core minimum; a decode token is one block);
- a *key split* is a fixed range of :data:`KV_SPLIT_SIZE` key positions. Each split's keys are
  walked in tiles of :data:`KV_TILE` keys (several cache blocks per tile, gathered through the
  block table, ``head_dim`` contiguous), scores and the value product on the tensor cores with
  fp32 accumulation and an fp32 online softmax. With more than one split the unnormalized
  partial results go to a workspace and a second kernel merges them in split order.

The grid is sized from shapes only (tokens, requests, block-table width), and each program finds
its request, first token and lengths on the device (an in-register scan of ``query_lengths``),
so the launch has no host synchronization and can be captured in a CUDA graph.

Batch invariance: a row's result depends only on its own request's keys, through tiles and
splits at fixed key positions, merged in a fixed order; a tile or split that holds no key of a row
leaves that row's state bitwise unchanged, and a merge of one split equals the unsplit result. So
a token gets the same bits in a decode step, in a prefill chunk of any size, and in a batch of any
composition or block-table width (pausing, eviction and chunked prefill never change outputs).

NaN safety: keys at or past the request's length are never loaded (masked loads give 0), keys
past a row's causal position get score ``-inf`` and weight exactly 0 on a finite value, so NaN in
an unused block tail or an unrelated block never reaches the output.

Under ``TRITON_INTERPRET=1`` (set before this module is imported, when the kernels are decorated)
it also runs on CPU tensors, which is how the unit tests check it without a GPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from megatron.core.inference.contexts.paged_attention import check_inputs

KV_SPLIT_SIZE = 512  # key positions per split
KV_TILE = 64  # key positions per inner iteration
MIN_ROWS = 16  # tl.dot's smallest M
# Warps per program: a constant (it fixes the products' order, hence the bits, for every step).
# H200, 64 decode requests of the 1.4B model (16 heads x 128): 2 warps read K/V at 2.68 TB/s at
# 128-256 keys and 4.12 TB/s at 1.5k-2.5k, against 2.53 and 3.70 with 4 warps.
ATTENTION_WARPS = 2
# Triton's interpreter multiplies 16-bit operands of tl.dot wrongly: it gets them in fp32.
UPCAST_DOT_OPERANDS = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_acc_ptr,
    part_stats_ptr,
    splits_used_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    table_ptr,
    q_len_ptr,
    kv_len_ptr,
    num_requests,
    table_width,
    num_splits,
    num_q_heads,
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
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    TILE: tl.constexpr,
    REQ_PAD: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # This block's request, first packed token and lengths, by a scan of the query lengths in
    # registers (a block past the last gets 0 new tokens: no valid row).
    req = tl.arange(0, REQ_PAD)
    q_lens = tl.load(q_len_ptr + req, mask=req < num_requests, other=0).to(tl.int32)
    blocks = (q_lens + TOKENS - 1) // TOKENS
    blocks_end = tl.cumsum(blocks, 0)
    request = tl.sum((blocks_end <= block).to(tl.int32), 0)
    mine = req == request
    first_token = tl.sum(tl.where(mine, tl.cumsum(q_lens, 0) - q_lens, 0), 0)
    q_len = tl.where(block < tl.sum(blocks, 0), tl.sum(tl.where(mine, q_lens, 0), 0), 0)
    block_in_request = block - tl.sum(tl.where(mine, blocks_end - blocks, 0), 0)
    request = tl.minimum(request, num_requests - 1)
    kv_len = tl.load(kv_len_ptr + request).to(tl.int32)

    rows = tl.arange(0, TOKENS * GROUP_PAD)
    token_in_request = block_in_request * TOKENS + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token_in_request < q_len) & (rows % GROUP_PAD < GROUP)
    token = (first_token + token_in_request).to(tl.int64)
    position = tl.where(row_ok, kv_len - q_len + token_in_request, -1)  # keys 0..position visible
    dims = tl.arange(0, DIM)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    split_start = split * SPLIT
    split_end = tl.minimum(split_start + SPLIT, tl.max(position, 0) + 1)
    num_tiles = tl.maximum(tl.cdiv(split_end - split_start, TILE), 0)
    running_max = tl.full([TOKENS * GROUP_PAD], -float("inf"), tl.float32)
    running_sum = tl.zeros([TOKENS * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([TOKENS * GROUP_PAD, DIM], dtype=tl.float32)
    keys = tl.arange(0, TILE)
    for tile in range(0, num_tiles):
        key_pos = split_start + tile * TILE + keys
        key_ok = key_pos < kv_len
        column = key_pos // BLOCK_SIZE
        block_id = tl.load(table_ptr + request * stride_tr + column, mask=key_ok & (column < table_width), other=0).to(
            tl.int64
        )
        in_block = (key_pos % BLOCK_SIZE).to(tl.int64)
        tile_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            key_ptr + (block_id * stride_kb + in_block * stride_ks + kv_head * stride_kh)[:, None] + dims[None, :],
            mask=tile_ok,
            other=0.0,
        )
        v = tl.load(
            value_ptr + (block_id * stride_vb + in_block * stride_vs + kv_head * stride_vh)[:, None] + dims[None, :],
            mask=tile_ok,
            other=0.0,
        )
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(key_pos[None, :] <= position[:, None], scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # A row with no visible key yet keeps max -inf, sum 0 and acc 0 (no inf - inf).
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        correction = tl.exp(running_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, 1)
        if IEEE:
            acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
        running_max = new_max

    if WRITE_PARTIAL:
        # Unnormalized partials [tokens, q_heads, splits] of rows that have a key in this split,
        # and per token the number of splits that hold its keys (every KV head writes the same).
        if split == 0:
            tl.store(splits_used_ptr + token, position // SPLIT + 1, mask=row_ok)
        part = (token * num_q_heads + head) * num_splits + split
        part_ok = row_ok & (split_start <= position)
        tl.store(part_acc_ptr + part[:, None] * DIM + dims[None, :], acc, mask=part_ok[:, None])
        tl.store(part_stats_ptr + part * 2, running_max, mask=part_ok)
        tl.store(part_stats_ptr + part * 2 + 1, running_sum, mask=part_ok)
    else:
        result = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]  # 0 only in unused rows
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_stats_ptr,
    splits_used_ptr,
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM: tl.constexpr,
):
    """One program per (token, query head): the partials of the splits holding the token's keys
    merged in split order (no split past them is read, so their number never matters); a
    padding token (no split) gets 0."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, DIM)
    first = (token * num_q_heads + head) * num_splits
    merged_max = tl.full([], -float("inf"), tl.float32)
    merged_sum = tl.full([], 0.0, tl.float32)
    merged = tl.zeros([DIM], dtype=tl.float32)
    for split in range(0, tl.load(splits_used_ptr + token)):
        part_max = tl.load(part_stats_ptr + (first + split) * 2)
        part_sum = tl.load(part_stats_ptr + (first + split) * 2 + 1)
        part_acc = tl.load(part_acc_ptr + (first + split) * DIM + dims)
        new_max = tl.maximum(merged_max, part_max)
        old_weight = tl.exp(merged_max - new_max)
        part_weight = tl.exp(part_max - new_max)
        merged = merged * old_weight + part_acc * part_weight
        merged_sum = merged_sum * old_weight + part_sum * part_weight
        merged_max = new_max
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        (merged / tl.where(merged_sum == 0.0, 1.0, merged_sum)).to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def triton_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lengths: torch.Tensor,
    kv_lengths: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    validate: bool = True,
    kv_split_size: int = KV_SPLIT_SIZE,
) -> torch.Tensor:
    """Attention of packed queries over their requests' paged keys and values (fused kernel).

    Arguments and result as
    :func:`~megatron.core.inference.contexts.paged_attention.torch_paged_attention`: ``query
    [tokens, q_heads, head_dim]``, caches ``[blocks, block_size, kv_heads, head_dim]``,
    ``block_tables [requests, max_blocks]``, ``query_lengths, kv_lengths [requests]`` (on the
    device); returns ``[tokens, q_heads, head_dim]`` in the dtype of ``query`` (rows past
    ``sum(query_lengths)``, e.g. a CUDA graph's padding, are zero).

    ``validate`` checks the lengths against the packed queries, which reads them on the host:
    pass False on the hot path (it is skipped during CUDA-graph capture in any case).
    ``kv_split_size``: key positions per split (a power of two >= 16; tiles of
    ``min(KV_TILE, kv_split_size)`` keys); outputs are batch invariant for a fixed value (tests
    use small ones to exercise several splits).
    """
    num_tokens, q_heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if kv_split_size < 16 or kv_split_size & (kv_split_size - 1):
        raise ValueError(f"kv_split_size must be a power of two >= 16, got {kv_split_size}")
    if validate and not _capturing(query):
        check_inputs(query, key_cache, query_lengths, kv_lengths)
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    num_requests = query_lengths.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    # The kernel indexes the innermost (head_dim) axis with unit stride.
    query, key_cache, value_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (query, key_cache, value_cache)
    )
    block_tables = block_tables.contiguous()
    group = q_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    tokens_per_block = max(MIN_ROWS // group_pad, 1)
    dim = max(16, triton.next_power_of_2(head_dim))
    req_pad = max(64, triton.next_power_of_2(num_requests))  # few variants to compile
    num_blocks = min(num_tokens, triton.cdiv(num_tokens, tokens_per_block) + num_requests)
    num_splits = max(1, triton.cdiv(block_tables.shape[1] * block_size, kv_split_size))
    if num_splits > 1:
        part_acc = torch.empty(num_tokens * q_heads * num_splits, dim, dtype=torch.float32, device=query.device)
        part_stats = torch.empty(num_tokens * q_heads * num_splits, 2, dtype=torch.float32, device=query.device)
        splits_used = torch.zeros(num_tokens, dtype=torch.int32, device=query.device)
    else:
        part_acc = part_stats = splits_used = out  # unused
    common = dict(IEEE=query.dtype == torch.float32, UPCAST=UPCAST_DOT_OPERANDS)
    _paged_attention_kernel[(num_blocks, kv_heads, num_splits)](
        out,
        part_acc,
        part_stats,
        splits_used,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_lengths,
        kv_lengths,
        num_requests,
        block_tables.shape[1],
        num_splits,
        q_heads,
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
        GROUP=group,
        GROUP_PAD=group_pad,
        TOKENS=tokens_per_block,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        DIM=dim,
        SPLIT=kv_split_size,
        TILE=min(KV_TILE, kv_split_size),
        REQ_PAD=req_pad,
        WRITE_PARTIAL=num_splits > 1,
        num_warps=ATTENTION_WARPS,
        num_stages=2,
        **common,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, q_heads)](
            out,
            part_acc,
            part_stats,
            splits_used,
            q_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            DIM=dim,
        )
    return out
