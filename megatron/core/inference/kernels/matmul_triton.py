"""Batch-invariant Triton GEMM for the inference linears: ``out = x @ W.T (+ bias)``.

cuBLAS picks its algorithm (tile shape, split-K, stream-K) from the problem size, so the bits of
one row of ``x @ W.T`` change with the number of rows it is computed with. Here every output
element is one program's fp32 accumulator, fed by tensor-core products of the same ``BLOCK_K``
slices in the same K order (no split-K, no atomics), with the same row tile and warp layout for
every batch: how one element is computed is a function of the weight's shape ``(N, K)`` only, so a
row's result is bitwise the same in a batch of any size and at any position in it. The row count
only picks the column tile (:func:`tile_config`): which program computes an element, not how (the
GPU test and ``benchmarks/inference_kernels_gpu.py`` check the bits at every bucket size).

Decode is memory bound (M = 1..256 rows against weights of up to 50304 x 2048): the weights must
stream from HBM once per step. The column tile is the widest that still gives every SM a program
(narrow tiles at one row tile, wider ones as the row tiles multiply, so the activations are not
re-read once per narrow column tile), and programs that share a weight tile are adjacent in launch
order, so the other row tiles read it from L2. Inputs bf16/fp16 (fp32 accumulation) or fp32 (IEEE
products, no TF32).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs on CPU tensors.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # one row tile, warp layout and tensor-core instruction for every batch size
COLUMN_TILES = (128, 64, 32, 16)
MIN_SM_COVERAGE = 0.9  # the column tile is the widest whose grid gives >= 90% of the SMs a program
INTERPRETER_SMS = 8  # stand-in SM count where there is no CUDA device
# Triton's interpreter multiplies 16-bit operands of tl.dot wrongly: it gets them in fp32.
UPCAST_DOT_OPERANDS = os.environ.get("TRITON_INTERPRET") == "1"


class TileConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def device_sm_count(device_index: int | None) -> int:
    """SMs of CUDA device ``device_index`` (a stand-in count for the interpreter, ``None``)."""
    if device_index is None:
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tile_config(n: int, k: int, m: int, element_size: int, num_sms: int) -> TileConfig:
    """Tiles for ``m`` rows against a weight of ``n`` output and ``k`` input features. The K step
    depends on the weight only (it fixes how an element is summed; see module doc); ``m`` only
    widens the column tile: the widest of ``COLUMN_TILES`` whose grid still covers the SMs."""
    row_tiles = triton.cdiv(max(m, 1), BLOCK_M)
    wanted = MIN_SM_COVERAGE * num_sms
    block_n = next((b for b in COLUMN_TILES if row_tiles * triton.cdiv(n, b) >= wanted), COLUMN_TILES[-1])
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(64 if element_size >= 4 else 128, max(16, triton.next_power_of_2(k)))
    return TileConfig(block_n, block_k, num_warps=4, num_stages=3)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
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
):
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - k * BLOCK_K
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
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


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
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, config.block_n),)
    _linear_kernel[grid](
        x2,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        UPCAST=UPCAST_DOT_OPERANDS,
        BLOCK_M=BLOCK_M,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out.reshape(*lead, n)
