"""Triton depthwise causal conv1d + SiLU, forward and backward: the CUDA counterpart of
:func:`~megatron.core.ssm.mixer_reference.causal_conv1d_silu` for a fresh sequence (no history).

``out[b, t, c] = silu(bias[c] + sum_k weight[c, 0, k] * x[b, t - (K - 1) + k, c])``, zeros before
the first token. ``x``, ``out`` and the gradients are ``[b, s, c]`` views with channel stride 1
and any batch and sequence strides: the conv reads its channels straight out of the packed
in_proj output and its backward writes the input gradient straight into the packed gradient,
so neither direction splits, transposes or concatenates. fp32 arithmetic, results in the
tensors' dtypes.

The backward saves nothing: it recomputes the pre-activation (for SiLU's derivative) from x, in
two passes. The first reads x (the K shifted tap reads of a tile hit the cache) and the output
gradient once and writes every token's pre-activation gradient, in fp32, to a scratch
``[b, s, c]`` buffer; it also sums the weight and bias gradients per program in fp32 (register
tiles over the program's tokens, reduced once at its end), summed over programs afterwards in a
fixed order (deterministic). The second gathers token t's input
gradient from the pre-activation gradients of tokens t .. t + K - 1 (shifted reads of the
scratch). One pass would recompute each token's pre-activation and SiLU K times (a register tile
cannot be shifted), which made the backward about 16 times slower than its memory traffic on an
H200 (2.7 ms per call at the hybrid benchmark's [8, 2048, 6144]; these two passes: 1.3 ms).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors,
which is how the unit tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.core.ssm.triton_launch import backward_programs, check_channel_view, with_channel_stride_1

BLOCK_T = 32  # tokens per tile
BLOCK_C = 128  # channels per tile (256 contiguous bytes of bf16)
BWD_TILES_PER_PROGRAM = 8  # token tiles one backward program walks (fewer weight-grad partials)
MAX_WIDTH = 4  # the backward keeps one register tile per tap (mamba-ssm's causal-conv1d: 2 to 4)


@triton.jit
def _conv1d_silu_fwd_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    seqlen,
    channels,
    stride_xb,
    stride_xs,
    stride_ob,
    stride_os,
    stride_wc,
    stride_wk,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    x_row = x_ptr + batch * stride_xb
    bias = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + bias[None, :]
    for k in tl.static_range(WIDTH):
        src = t - (WIDTH - 1) + k
        src_ok = (src >= 0) & (src < seqlen)
        xv = tl.load(x_row + src[:, None] * stride_xs + c[None, :], mask=src_ok[:, None] & c_ok[None, :], other=0.0)
        wk = tl.load(w_ptr + c * stride_wc + k * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wk[None, :]
    out = acc * tl.sigmoid(acc)
    out_ptrs = out_ptr + batch * stride_ob + t[:, None] * stride_os + c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(t < seqlen)[:, None] & c_ok[None, :])


@triton.jit
def _accumulate_tap(acc0, acc1, acc2, acc3, prod, k: tl.constexpr):
    """``prod`` added to tap ``k``'s accumulator (a register tile cannot be indexed by a tap)."""
    if k == 0:
        acc0 += prod
    elif k == 1:
        acc1 += prod
    elif k == 2:
        acc2 += prod
    else:
        acc3 += prod
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_tap(dw_ptrs, acc, c_ok, k: tl.constexpr, WIDTH: tl.constexpr):
    if k < WIDTH:
        tl.store(dw_ptrs + k, tl.sum(acc, axis=0), mask=c_ok)


@triton.jit
def _conv1d_silu_bwd_dpre_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    dout_ptr,
    dpre_ptr,
    dw_part_ptr,
    db_part_ptr,
    seqlen,
    channels,
    tiles_per_program,
    stride_xb,
    stride_xs,
    stride_gb,
    stride_gs,
    stride_wc,
    stride_wk,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 1: each token's pre-activation gradient (fp32, into ``dpre [b, s, c]``) and the
    program's weight and bias gradient partials. The partials accumulate elementwise in register
    tiles (one per tap) over the program's token tiles and are reduced over tokens once, at the
    end: a reduction per tile and tap made this pass 10 times slower than its memory traffic."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    batch = tl.program_id(2)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    x_row = x_ptr + batch.to(tl.int64) * stride_xb
    dout_row = dout_ptr + batch.to(tl.int64) * stride_gb
    dpre_row = dpre_ptr + batch.to(tl.int64) * seqlen * channels
    bias = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    acc0 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tile in range(tiles_per_program):
        t = ((pid_t * tiles_per_program + tile) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = (t < seqlen)[:, None] & c_ok[None, :]
        pre = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(WIDTH):
            src = t - (WIDTH - 1) + k
            src_ok = (src >= 0) & (src < seqlen)
            xv = tl.load(x_row + src[:, None] * stride_xs + c[None, :], mask=src_ok[:, None] & c_ok[None, :], other=0.0)
            wk = tl.load(w_ptr + c * stride_wc + k * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
            pre += xv.to(tl.float32) * wk[None, :]
        g = tl.load(dout_row + t[:, None] * stride_gs + c[None, :], mask=t_ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(pre)
        dpre = g * sig * (1.0 + pre * (1.0 - sig))
        tl.store(dpre_row + t[:, None] * channels + c[None, :], dpre, mask=t_ok)
        db_acc += dpre
        for k in tl.static_range(WIDTH):  # the tap inputs again: cache hits of the loads above
            src = t - (WIDTH - 1) + k
            src_ok = (src >= 0) & (src < seqlen)
            xv = tl.load(x_row + src[:, None] * stride_xs + c[None, :], mask=src_ok[:, None] & c_ok[None, :], other=0.0)
            acc0, acc1, acc2, acc3 = _accumulate_tap(acc0, acc1, acc2, acc3, dpre * xv.to(tl.float32), k)
    part = batch * tl.num_programs(0) + pid_t
    dw_ptrs = dw_part_ptr + (part * channels + c) * WIDTH
    _store_tap(dw_ptrs, acc0, c_ok, 0, WIDTH)
    _store_tap(dw_ptrs, acc1, c_ok, 1, WIDTH)
    _store_tap(dw_ptrs, acc2, c_ok, 2, WIDTH)
    _store_tap(dw_ptrs, acc3, c_ok, 3, WIDTH)
    tl.store(db_part_ptr + part * channels + c, tl.sum(db_acc, axis=0), mask=c_ok)


@triton.jit
def _conv1d_silu_bwd_dx_kernel(
    dpre_ptr,
    w_ptr,
    dx_ptr,
    seqlen,
    channels,
    stride_dxb,
    stride_dxs,
    stride_wc,
    stride_wk,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 2: ``dx[t] = sum_j dpre[t + j] * w[K - 1 - j]`` (j in order, fp32)."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    dpre_row = dpre_ptr + batch * seqlen * channels
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    # Token t + j's pre-activation gradient reaches x[t] through tap K - 1 - j.
    for j in tl.static_range(WIDTH):
        s = t + j
        s_ok = (s < seqlen)[:, None] & c_ok[None, :]
        d = tl.load(dpre_row + s[:, None] * channels + c[None, :], mask=s_ok, other=0.0)
        w_tap = tl.load(w_ptr + c * stride_wc + (WIDTH - 1 - j) * stride_wk, mask=c_ok, other=0.0)
        dx += d * w_tap.to(tl.float32)[None, :]
    dx_ptrs = dx_ptr + batch * stride_dxb + t[:, None] * stride_dxs + c[None, :]
    tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=(t < seqlen)[:, None] & c_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[int, int, int, int]:
    batch, seqlen, channels = x.shape
    if x.stride(-1) != 1:
        raise ValueError(f"conv1d input needs channel stride 1, got strides {tuple(x.stride())}")
    if weight.dim() != 3 or weight.shape[:2] != (channels, 1) or bias.shape != (channels,):
        raise ValueError(
            f"conv1d weight must be [{channels}, 1, width] and bias [{channels}], "
            f"got {tuple(weight.shape)} and {tuple(bias.shape)}"
        )
    if weight.shape[-1] > MAX_WIDTH:
        raise ValueError(f"conv1d width (mamba_d_conv) must be at most {MAX_WIDTH}, got {weight.shape[-1]}")
    return batch, seqlen, channels, weight.shape[-1]


def empty_like_token_order(x: torch.Tensor, channels: int | None = None, dtype: torch.dtype | None = None):
    """An uninitialized ``[b, s, channels]`` tensor laid out in x's token order: sequence-major
    (``[s, b, c]`` memory) when x is, else batch-major; channel stride 1 either way."""
    batch, seqlen, own_channels = x.shape
    channels = own_channels if channels is None else channels
    dtype = x.dtype if dtype is None else dtype
    if x.stride(0) < x.stride(1):  # sequence-major
        return torch.empty(seqlen, batch, channels, dtype=dtype, device=x.device).transpose(0, 1)
    return torch.empty(batch, seqlen, channels, dtype=dtype, device=x.device)


def conv1d_silu_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(causal_depthwise_conv1d(x) + bias)`` of ``x [b, s, c]`` (weight ``[c, 1, K]``), into
    ``out`` (allocated in x's token order when None)."""
    batch, seqlen, channels, width = _check(x, weight, bias)
    out = empty_like_token_order(x) if out is None else out
    check_channel_view("conv1d", "out", out, x.shape)
    grid = (triton.cdiv(seqlen, BLOCK_T), triton.cdiv(channels, BLOCK_C), batch)
    _conv1d_silu_fwd_kernel[grid](
        x,
        weight,
        bias,
        out,
        seqlen,
        channels,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        weight.stride(0),
        weight.stride(2),
        WIDTH=width,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
    )
    return out


def conv1d_silu_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    grad_out: torch.Tensor,
    grad_x: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`conv1d_silu_forward` given ``grad_out [b, s, c]``: ``(grad_x, grad_weight,
    grad_bias)``, grad_x written into ``grad_x`` when given (any token strides, channel stride 1)."""
    batch, seqlen, channels, width = _check(x, weight, bias)
    grad_out = with_channel_stride_1(grad_out)
    grad_x = empty_like_token_order(x) if grad_x is None else grad_x
    for name, t in (("grad_out", grad_out), ("grad_x", grad_x)):
        check_channel_view("conv1d", name, t, x.shape)
    token_programs, tiles = backward_programs(seqlen, BLOCK_T, BLOCK_T * BWD_TILES_PER_PROGRAM)
    parts = batch * token_programs
    dw_part = torch.empty(parts, channels, width, dtype=torch.float32, device=x.device)
    db_part = torch.empty(parts, channels, dtype=torch.float32, device=x.device)
    dpre = torch.empty(batch, seqlen, channels, dtype=torch.float32, device=x.device)
    channel_blocks = triton.cdiv(channels, BLOCK_C)
    _conv1d_silu_bwd_dpre_kernel[(token_programs, channel_blocks, batch)](
        x,
        weight,
        bias,
        grad_out,
        dpre,
        dw_part,
        db_part,
        seqlen,
        channels,
        tiles,
        x.stride(0),
        x.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        weight.stride(0),
        weight.stride(2),
        WIDTH=width,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
        num_warps=8,
    )
    _conv1d_silu_bwd_dx_kernel[(triton.cdiv(seqlen, BLOCK_T), channel_blocks, batch)](
        dpre,
        weight,
        grad_x,
        seqlen,
        channels,
        grad_x.stride(0),
        grad_x.stride(1),
        weight.stride(0),
        weight.stride(2),
        WIDTH=width,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
    )
    grad_weight = dw_part.sum(0).unsqueeze(1).to(weight.dtype)
    grad_bias = db_part.sum(0).to(bias.dtype)
    return grad_x, grad_weight, grad_bias
