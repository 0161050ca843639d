"""Batch-invariant Triton GEMM for the inference linears: ``out = x @ W.T (+ bias)``.

cuBLAS picks its algorithm (tile shape, split-K, stream-K) from the problem size, so the bits of
one row of ``x @ W.T`` change with the number of rows it is computed with. Here every output
element is an fp32 sum fed by tensor-core products of the same ``BLOCK_K`` slices in the same K
order, with the same row tile and warp layout for every batch. A weight whose reduction is long
next to its output (an MLP's down projection) has its K tiles cut into fixed slices whose fp32
partials are added in slice order: for a few rows each slice runs on a program of its own and a
second kernel adds the partials; for more rows one program sums the slices itself; the same
additions in the same order either way. How one element is computed is thus a function of the
weight's shape ``(N, K)`` and the device only, so a row's result is bitwise the same in a batch of
any size and at any position in it. The row count only picks the tiles and where slices run
(:func:`tile_config`): which program computes an element, not how. Long prefill steps take 128-row
tiles on two warpgroups with shorter K steps: each 64 rows still get the same tensor-core
instruction over the same K order (the GPU test and ``benchmarks/inference_kernels_gpu.py`` check
the bits at every bucket size).

Decode is memory bound (M = 1..256 rows against weights of up to 50304 x 2048): the weights must
stream from HBM once per step. The column tile is the widest that still gives every SM a program
(narrow tiles at one row tile, wider ones as the row tiles multiply, so the activations are not
re-read once per narrow column tile), programs that share a weight tile are adjacent in launch
order, so the other row tiles read it from L2, and K slices give a narrow weight with a long
reduction enough programs. Inputs bf16/fp16 (fp32 accumulation) or fp32 (IEEE products, no TF32).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs on CPU tensors.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # the row tile of decode and short prefill steps (one warpgroup's tensor-core instruction)
# Long 16-bit prefill steps (>= PREFILL_ROWS rows) take 128-row tiles on two warpgroups, 64-deep K
# steps and 4 stages: the same tensor-core instruction per 64 rows and the same K order, so the same
# bits (the GPU test checks every bucket up to 2048 rows), 1.3-1.5x faster on the H200 at 2048
# rows (QKV 6144 x 2048: 110 us against 160; fc1 11008 x 2048: 203 against 277; out-proj 37 against 54).
PREFILL_ROWS = 1024
PREFILL_BLOCK_M, PREFILL_BLOCK_K, PREFILL_WARPS, PREFILL_STAGES = 128, 64, 8, 4
COLUMN_TILES = (128, 64, 32, 16)
MIN_SM_COVERAGE = 0.9  # the column tile is the widest whose grid gives >= 90% of the SMs a program
INTERPRETER_SMS = 8  # stand-in SM count where there is no CUDA device
# K slices, for weights whose reduction is long next to their output (K >= SLICED_K_OVER_N x N, like
# an MLP's down projection): enough that a one-row decode GEMM has SPLIT_PROGRAMS_PER_SM programs per
# SM with column tiles of SPLIT_BLOCK_N, at most MAX_K_SLICES, each at least MIN_SLICE_TILES K tiles
# long. Slices run on programs of their own up to SPLIT_MAX_ROWS rows. (H200, bf16, 2048 x 5504:
# 9.0 us at 1 and 64 rows against 14.1 us unsliced; square and wide weights gain nothing, and
# summing slices in one program slows a 2048-row prefill GEMM by ~1.6x, so they are not sliced.)
SLICED_K_OVER_N = 2
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_BLOCK_N = 64
MAX_K_SLICES = 8
MIN_SLICE_TILES = 2
SPLIT_MAX_ROWS = 64
SUM_BLOCK = 1024
# Triton's interpreter multiplies 16-bit operands of tl.dot wrongly: it gets them in fp32.
UPCAST_DOT_OPERANDS = os.environ.get("TRITON_INTERPRET") == "1"


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    slice_tiles: int  # K tiles per slice (a function of the weight and the device only)
    split: bool  # slices on programs of their own (few rows) or summed in one program


@functools.lru_cache(maxsize=8)
def device_sm_count(device_index: int | None) -> int:
    """SMs of CUDA device ``device_index`` (a stand-in count for the interpreter, ``None``)."""
    if device_index is None:
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def k_slice_tiles(n: int, k: int, block_k: int, num_sms: int) -> int:
    """K tiles per slice for a weight of ``n`` x ``k``: ``K`` is cut into slices whose fp32
    partials are added in slice order, so that a decode batch of a few rows can spread a long
    reduction over more programs (see the constants above). A function of the weight shape and
    the device, never of the row count (it fixes how an element is summed)."""
    k_tiles = triton.cdiv(k, block_k)
    if k < SLICED_K_OVER_N * n:
        return k_tiles
    column_tiles = triton.cdiv(n, SPLIT_BLOCK_N)
    slices = triton.next_power_of_2(triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms, column_tiles))
    slices = max(1, min(slices, MAX_K_SLICES, k_tiles // MIN_SLICE_TILES))
    return triton.cdiv(k_tiles, slices)


def tile_config(n: int, k: int, m: int, element_size: int, num_sms: int) -> TileConfig:
    """Tiles for ``m`` rows against a weight of ``n`` output and ``k`` input features. The K step
    and the K slices depend on the weight only (they fix how an element is summed; see module
    doc); ``m`` picks whether slices run on programs of their own (up to ``SPLIT_MAX_ROWS``), the
    row tile (``PREFILL_BLOCK_M`` from ``PREFILL_ROWS`` 16-bit rows on) and the column tile: the
    widest of ``COLUMN_TILES`` whose grid still covers the SMs."""
    block_k = min(64 if element_size >= 4 else 128, max(16, triton.next_power_of_2(k)))
    slice_tiles = k_slice_tiles(n, k, block_k, num_sms)
    if slice_tiles < triton.cdiv(k, block_k) and m <= SPLIT_MAX_ROWS:
        block_n = min(SPLIT_BLOCK_N, max(16, triton.next_power_of_2(n)))
        return TileConfig(BLOCK_M, block_n, block_k, 4, 3, slice_tiles, True)
    block_m, num_warps, num_stages = BLOCK_M, 4, 3
    if m >= PREFILL_ROWS and element_size == 2 and block_k % PREFILL_BLOCK_K == 0:
        # The same slices in K elements, cut into shorter K steps.
        slice_tiles *= block_k // PREFILL_BLOCK_K
        block_m, block_k, num_warps, num_stages = PREFILL_BLOCK_M, PREFILL_BLOCK_K, PREFILL_WARPS, PREFILL_STAGES
    row_tiles = triton.cdiv(max(m, 1), block_m)
    wanted = MIN_SM_COVERAGE * num_sms
    block_n = next((b for b in COLUMN_TILES if row_tiles * triton.cdiv(n, b) >= wanted), COLUMN_TILES[-1])
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    return TileConfig(block_m, block_n, block_k, num_warps, num_stages, slice_tiles, split=False)


@triton.jit
def _slice_partial(x_ptrs, w_ptrs, row_ok, col_ok, ks, K, tile_start, tile_end, acc, IEEE, UPCAST, BLOCK_K):
    """``acc`` plus the products of K tiles ``[tile_start, tile_end)`` (in K order)."""
    x_ptrs += tile_start * BLOCK_K
    w_ptrs += tile_start * BLOCK_K
    for t in range(tile_start, tile_end):
        k_ok = ks < K - t * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLICE_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Without ``SPLIT``: one program per output tile sums every K slice of ``SLICE_TILES`` tiles
    into its own fp32 partial, adds the partials in slice order and writes the result. With
    ``SPLIT``: program ``(tile, s)`` writes slice ``s``'s partial to ``partial_ptr[s]`` and
    :func:`_sum_slices_kernel` adds them in the same order: the same bits either way."""
    pid = tl.program_id(0)
    num_row_tiles = tl.cdiv(M, BLOCK_M)
    # Row tiles vary fastest: the programs reading one weight tile run side by side.
    pid_m = pid % num_row_tiles
    pid_n = pid // num_row_tiles
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N] tile of W.T
    k_tiles = tl.cdiv(K, BLOCK_K)
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        s = tl.program_id(1)
        first = s * SLICE_TILES
        acc = _slice_partial(
            x_ptrs, w_ptrs, row_ok, col_ok, ks, K, first, tl.minimum(first + SLICE_TILES, k_tiles), zeros,
            IEEE, UPCAST, BLOCK_K,
        )  # fmt: skip
        partial_ptrs = partial_ptr + s * M * N + rows[:, None] * N + cols[None, :]
        tl.store(partial_ptrs, acc, mask=mask)
    else:
        if SLICE_TILES >= k_tiles:  # one slice: its partial is the sum
            acc = _slice_partial(x_ptrs, w_ptrs, row_ok, col_ok, ks, K, 0, k_tiles, zeros, IEEE, UPCAST, BLOCK_K)
        else:
            acc = zeros
            for first in range(0, k_tiles, SLICE_TILES):
                acc += _slice_partial(
                    x_ptrs, w_ptrs, row_ok, col_ok, ks, K, first, tl.minimum(first + SLICE_TILES, k_tiles), zeros,
                    IEEE, UPCAST, BLOCK_K,
                )  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_slices_kernel(
    partial_ptr, bias_ptr, out_ptr, M, N, stride_om, SLICES, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """``out = (0 + p_0 + p_1 + ...) (+ bias)`` over the slice partials, in slice order."""
    offsets = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = offsets < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SLICES):
        acc += tl.load(partial_ptr + s * M * N + offsets, mask=ok, other=0.0)
    cols = offsets % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offsets // N) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def triton_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: TileConfig | None = None
) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias [N])`` in ``x``'s dtype, batch invariant (see
    module doc). Forward only. ``config`` overrides :func:`tile_config` (benchmark sweeps)."""
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(
            f"linear input [..., {k}] {x.dtype} does not match the weight {tuple(weight.shape)} {weight.dtype}"
        )
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    device_index = x.device.index if x.device.type == "cuda" else None
    if device_index is None and x.device.type == "cuda":
        device_index = torch.cuda.current_device()
    config = config or tile_config(n, k, m, x.element_size(), device_sm_count(device_index))
    slices = triton.cdiv(triton.cdiv(k, config.block_k), config.slice_tiles) if config.split else 1
    partial = torch.empty(slices, m, n, dtype=torch.float32, device=x.device) if config.split else out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), slices)
    _linear_kernel[grid](
        x2,
        weight,
        bias if bias is not None else weight,
        out,
        partial,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        UPCAST=UPCAST_DOT_OPERANDS,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SLICE_TILES=config.slice_tiles,
        SPLIT=config.split,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.split:
        _sum_slices_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            partial,
            bias if bias is not None else weight,
            out,
            m,
            n,
            out.stride(0),
            slices,
            HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK,
        )
    return out.reshape(*lead, n)
