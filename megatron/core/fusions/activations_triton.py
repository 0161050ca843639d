"""Triton kernels of :mod:`megatron.core.fusions.activations`: ``act(x + bias)`` and the gated
``act(gate + b_g) * (up + b_u)`` over fc1's packed ``[gate | up]`` output, forward and backward.

Forward tiles of ``[BLOCK_R rows, BLOCK_C channels]``. The backward reads the gradient and the
saved input once and writes the gradient of the packed input once (gate and up halves of one
buffer, in place of a split and a concatenation); it recomputes the activation from the saved
input (nothing else is kept) and sums the bias gradient in registers while each program walks
its range of rows (one fp32 partial per row split, added up afterwards), so no extra read of the
gradient is needed for it. All math is fp32. ``ACT``: 0 GELU (erf), 1 GELU
(tanh approximation), 2 SiLU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.core.fusions.norms_triton import program_count

ACT_CODES = {"gelu": 0, "gelu_tanh": 1, "silu": 2}
# Globals a kernel reads must be constexpr for the Triton compiler.
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_PI = tl.constexpr(0.7978845608028654)
_TANH_C = tl.constexpr(0.044715)
# Forward tiles: 2 rows x 1024 channels, 4 warps (an H200 sweep of 1-32 rows, 256-2048 channels,
# 4-8 warps: [16384, 8192] GELU + bias 0.243 -> 0.220 ms, [16384, 2 x 5504] SwiGLU 0.174 -> 0.155
# ms against 16 x 256; elementwise, so the same bits at any tile).
BLOCK_R, BLOCK_C = 2, 1024
# Backward tiles: 8 rows x 1024 channels (8 warps: 32 elements a thread per tensor, in 16-byte
# vectors), looped over each program's rows with the bias gradient kept in registers; 8 programs
# per SM in one wave. Memory-bound at ~3 tensor passes, with the erf GELU's ~40 fp32 instructions
# per element close behind. A sweep on an H200 (rows 8-32, channels 512-1024, 4-8 warps, 4-16
# programs per SM) put this among the fastest for both [16384, 8192] GELU + bias (0.315 ms, was
# 0.384 with 512 channels and 4 programs per SM) and [16384, 2 x 5504] SwiGLU (0.248, was 0.264).
BLOCK_BWD_R, BLOCK_BWD_C, BWD_WARPS, BWD_PROGRAMS_PER_SM = 8, 1024, 8, 8


@triton.jit
def _act_and_grad(a, ACT: tl.constexpr):
    """``(act(a), act'(a))`` in fp32 (a forward kernel drops the unused derivative)."""
    if ACT == 0:
        cdf = 0.5 * (1.0 + tl.math.erf(a * _SQRT1_2))
        y = a * cdf
        dy = cdf + a * _INV_SQRT_2PI * tl.exp(-0.5 * a * a)
    elif ACT == 1:
        inner = _SQRT_2_PI * (a + _TANH_C * a * a * a)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh
        y = 0.5 * a * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3.0 * _TANH_C * a * a)
    else:
        sig = tl.sigmoid(a)
        y = a * sig
        dy = sig * (1.0 + a * (1.0 - sig))
    return y, dy


@triton.jit
def _act_fwd_kernel(
    x_ptr,
    bias_ptr,
    y_ptr,
    n_rows,
    n_cols,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    in_cols = 2 * n_cols if GATED else n_cols
    x_offs = rows[:, None] * in_cols + cols[None, :]
    a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    y, _ = _act_and_grad(a, ACT)
    if GATED:
        up = tl.load(x_ptr + x_offs + n_cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            up += tl.load(bias_ptr + n_cols + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        y = y * up
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    dy_ptr,
    x_ptr,
    bias_ptr,
    dx_ptr,
    dbias_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    in_cols = 2 * n_cols if GATED else n_cols
    if HAS_BIAS:
        bias_gate = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            bias_up = tl.load(bias_ptr + n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc_gate = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    row_start = split * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for first in range(row_start, row_end, BLOCK_R):
        rows = (first + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (rows < row_end)[:, None] & col_ok[None, :]
        x_offs = rows[:, None] * in_cols + cols[None, :]
        g = tl.load(dy_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += bias_gate
        act, dact = _act_and_grad(a, ACT)
        if GATED:
            up = tl.load(x_ptr + x_offs + n_cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                up += bias_up
            da = g * up * dact
            dup = g * act
            tl.store(dx_ptr + x_offs + n_cols, dup.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_BIAS:
                acc_up += tl.where(mask, dup, 0.0)
        else:
            da = g * dact
        tl.store(dx_ptr + x_offs, da.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc_gate += tl.where(mask, da, 0.0)
    if HAS_BIAS:
        partial = split.to(tl.int64) * in_cols + cols
        tl.store(dbias_ptr + partial, tl.sum(acc_gate, axis=0), mask=col_ok)
        if GATED:
            tl.store(dbias_ptr + partial + n_cols, tl.sum(acc_up, axis=0), mask=col_ok)


def _grid(n_rows: int, n_cols: int) -> tuple[int, int]:
    return triton.cdiv(n_rows, BLOCK_R), triton.cdiv(n_cols, BLOCK_C)


def activation_forward(x: torch.Tensor, bias: torch.Tensor | None, act: str, gated: bool) -> torch.Tensor:
    """``x`` 2-D contiguous ``[rows, n]`` (``[rows, 2n]`` packed ``[gate | up]`` when gated)."""
    n_rows, in_cols = x.shape
    n_cols = in_cols // 2 if gated else in_cols
    y = torch.empty(n_rows, n_cols, device=x.device, dtype=x.dtype)
    _act_fwd_kernel[_grid(n_rows, n_cols)](
        x, bias, y, n_rows, n_cols, ACT_CODES[act], gated, bias is not None, BLOCK_R, BLOCK_C, num_warps=4
    )
    return y


def backward_grid(n_rows: int, n_cols: int, programs: int) -> tuple[tuple[int, int], int]:
    """The backward's grid ``(column blocks, row splits)`` and rows per split: about ``programs``
    programs in all (one wave over the SMs), each walking a contiguous, ``BLOCK_BWD_R``-aligned
    range of rows, so the bias gradient leaves one fp32 partial per split."""
    col_blocks = triton.cdiv(n_cols, BLOCK_BWD_C)
    splits = max(1, min(triton.cdiv(n_rows, BLOCK_BWD_R), programs // col_blocks))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, splits), BLOCK_BWD_R) * BLOCK_BWD_R
    return (col_blocks, triton.cdiv(n_rows, rows_per_program)), rows_per_program


def activation_backward(dy, x, bias, act: str, gated: bool):
    """``(d_x, d_bias or None)``: the packed input's gradient and the bias's."""
    n_rows, in_cols = x.shape
    n_cols = in_cols // 2 if gated else in_cols
    dx = torch.empty_like(x)
    grid, rows_per_program = backward_grid(n_rows, n_cols, program_count(x.device, BWD_PROGRAMS_PER_SM))
    dbias = torch.empty(grid[1], in_cols, device=x.device, dtype=torch.float32) if bias is not None else None
    _act_bwd_kernel[grid](
        dy,
        x,
        bias,
        dx,
        dbias,
        n_rows,
        n_cols,
        rows_per_program,
        ACT_CODES[act],
        gated,
        bias is not None,
        BLOCK_BWD_R,
        BLOCK_BWD_C,
        num_warps=BWD_WARPS,
    )
    return dx, None if dbias is None else dbias.sum(0).to(bias.dtype)


class ActivationFunction(torch.autograd.Function):
    """Autograd of :func:`activation_forward`; saves only the input (and bias)."""

    @staticmethod
    def forward(ctx, x, bias, act, gated):
        ctx.save_for_backward(x, bias)
        ctx.act, ctx.gated = act, gated
        return activation_forward(x, bias, act, gated)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, dbias = activation_backward(dy.contiguous(), x, bias, ctx.act, ctx.gated)
        return dx, dbias, None, None
