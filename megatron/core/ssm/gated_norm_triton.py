"""Triton grouped gated RMSNorm, forward and backward: the CUDA counterpart of
:func:`~megatron.core.ssm.mixer_reference.gated_rms_norm`.

``out = weight * g * rsqrt(mean_group(g^2) + eps)`` with ``g = x * silu(gate)``, the mean taken
over each group of ``group_size`` channels. One kernel reads x and gate once and writes out once;
the backward reads x, gate and the output gradient once and writes both input gradients once,
recomputing the group statistic instead of saving it. Every tensor is a ``[d0, d1, n]`` view with
channel stride 1 and its own strides for the two token dimensions, so the scan's batch-major
output, the gate read out of the packed sequence-major in_proj output and the sequence-major
out_proj input meet in one kernel with no copy. fp32 arithmetic; the weight gradient is reduced
per program in fp32 and summed over programs in a fixed order (deterministic).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.core.ssm.triton_launch import backward_programs, check_channel_view, with_channel_stride_1

ELEMENTS_PER_TILE = 2048  # rows x group channels per tile (registers per live fp32 tensor)
BWD_ROWS_PER_PROGRAM = 64  # rows one backward program walks (fewer weight-grad partials)


@triton.jit
def _row_offsets(rows, d1, stride0, stride1):
    return (rows // d1).to(tl.int64) * stride0 + (rows % d1).to(tl.int64) * stride1


@triton.jit
def _gated_rms_norm_fwd_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    d1,
    eps,
    stride_x0,
    stride_x1,
    stride_g0,
    stride_g1,
    stride_o0,
    stride_o1,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_r = tl.program_id(0)
    group = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_G)
    ok = (rows < num_rows)[:, None] & (cols < GROUP)[None, :]
    channel = group * GROUP + cols
    x = tl.load(x_ptr + _row_offsets(rows, d1, stride_x0, stride_x1)[:, None] + channel[None, :], mask=ok, other=0.0)
    z = tl.load(gate_ptr + _row_offsets(rows, d1, stride_g0, stride_g1)[:, None] + channel[None, :], mask=ok, other=0.0)
    z = z.to(tl.float32)
    g = x.to(tl.float32) * z * tl.sigmoid(z)
    rstd = 1.0 / tl.sqrt(tl.sum(g * g, axis=1) / GROUP + eps)
    w = tl.load(w_ptr + channel, mask=cols < GROUP, other=0.0).to(tl.float32)
    out = g * rstd[:, None] * w[None, :]
    out_ptrs = out_ptr + _row_offsets(rows, d1, stride_o0, stride_o1)[:, None] + channel[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rms_norm_bwd_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    dout_ptr,
    dx_ptr,
    dgate_ptr,
    dw_part_ptr,
    num_rows,
    d1,
    channels,
    eps,
    tiles_per_program,
    stride_x0,
    stride_x1,
    stride_g0,
    stride_g1,
    stride_do0,
    stride_do1,
    stride_dx0,
    stride_dx1,
    stride_dg0,
    stride_dg1,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_r = tl.program_id(0)
    group = tl.program_id(1)
    cols = tl.arange(0, BLOCK_G)
    col_ok = cols < GROUP
    channel = group * GROUP + cols
    w = tl.load(w_ptr + channel, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_G,), dtype=tl.float32)
    for tile in range(tiles_per_program):
        rows = (pid_r * tiles_per_program + tile) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = (rows < num_rows)[:, None] & col_ok[None, :]
        x_offsets = _row_offsets(rows, d1, stride_x0, stride_x1)[:, None] + channel[None, :]
        g_offsets = _row_offsets(rows, d1, stride_g0, stride_g1)[:, None] + channel[None, :]
        x = tl.load(x_ptr + x_offsets, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(gate_ptr + g_offsets, mask=ok, other=0.0).to(tl.float32)
        dout_offsets = _row_offsets(rows, d1, stride_do0, stride_do1)[:, None] + channel[None, :]
        dout = tl.load(dout_ptr + dout_offsets, mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        silu = z * sig
        g = x * silu
        rstd = 1.0 / tl.sqrt(tl.sum(g * g, axis=1) / GROUP + eps)
        g_hat = g * rstd[:, None]
        dw_acc += tl.sum(dout * g_hat, axis=0)
        wdout = dout * w[None, :]
        dg = (wdout - g_hat * (tl.sum(g_hat * wdout, axis=1) / GROUP)[:, None]) * rstd[:, None]
        dx = dg * silu
        dz = dg * x * sig * (1.0 + z * (1.0 - sig))
        dx_ptrs = dx_ptr + _row_offsets(rows, d1, stride_dx0, stride_dx1)[:, None] + channel[None, :]
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dz_ptrs = dgate_ptr + _row_offsets(rows, d1, stride_dg0, stride_dg1)[:, None] + channel[None, :]
        tl.store(dz_ptrs, dz.to(dgate_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_part_ptr + pid_r * channels + channel, dw_acc, mask=col_ok)


def _tiling(channels: int, group_size: int) -> tuple[int, int, int]:
    if channels % group_size:
        raise ValueError(f"gated norm: {channels} channels do not split into groups of {group_size}")
    block_g = triton.next_power_of_2(group_size)
    return channels // group_size, block_g, max(1, ELEMENTS_PER_TILE // block_g)


def gated_rms_norm_forward(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated RMSNorm of ``x, gate [d0, d1, n]`` (weight ``[n]``) into ``out`` (a new
    contiguous ``[d0, d1, n]`` tensor of x's dtype when None)."""
    d0, d1, channels = x.shape
    ngroups, block_g, block_r = _tiling(channels, group_size)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    for name, t in (("x", x), ("gate", gate), ("out", out)):
        check_channel_view("gated norm", name, t, x.shape)
    grid = (triton.cdiv(d0 * d1, block_r), ngroups)
    _gated_rms_norm_fwd_kernel[grid](
        x,
        gate,
        weight,
        out,
        d0 * d1,
        d1,
        eps,
        x.stride(0),
        x.stride(1),
        gate.stride(0),
        gate.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group_size,
        BLOCK_G=block_g,
        BLOCK_R=block_r,
    )
    return out


def gated_rms_norm_backward(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    grad_out: torch.Tensor,
    group_size: int,
    eps: float,
    grad_x: torch.Tensor | None = None,
    grad_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`gated_rms_norm_forward`: ``(grad_x, grad_gate, grad_weight)``; the two
    input gradients are written into ``grad_x`` / ``grad_gate`` when given (new contiguous
    tensors otherwise)."""
    d0, d1, channels = x.shape
    ngroups, block_g, block_r = _tiling(channels, group_size)
    grad_out = with_channel_stride_1(grad_out)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if grad_x is None else grad_x
    grad_gate = torch.empty(x.shape, dtype=gate.dtype, device=x.device) if grad_gate is None else grad_gate
    for name, t in (("x", x), ("gate", gate), ("grad_out", grad_out), ("grad_x", grad_x), ("grad_gate", grad_gate)):
        check_channel_view("gated norm", name, t, x.shape)
    num_rows = d0 * d1
    row_programs, tiles = backward_programs(num_rows, block_r, BWD_ROWS_PER_PROGRAM)
    dw_part = torch.empty(row_programs, channels, dtype=torch.float32, device=x.device)
    _gated_rms_norm_bwd_kernel[(row_programs, ngroups)](
        x,
        gate,
        weight,
        grad_out,
        grad_x,
        grad_gate,
        dw_part,
        num_rows,
        d1,
        channels,
        eps,
        tiles,
        x.stride(0),
        x.stride(1),
        gate.stride(0),
        gate.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        grad_x.stride(0),
        grad_x.stride(1),
        grad_gate.stride(0),
        grad_gate.stride(1),
        GROUP=group_size,
        BLOCK_G=block_g,
        BLOCK_R=block_r,
    )
    return grad_x, grad_gate, dw_part.sum(0).to(weight.dtype)
