"""Triton kernels of :func:`megatron.core.fusions.rope.split_qkv` with RoPE.

One program per token: it reads the token's packed ``[Q | K | V]`` row, rotates every query
and key head by the token's angles (cos/sin computed in fp32 from ``freqs``; channels past
``rot`` pass through) and writes q ``[s, b, heads, d]``, k and v ``[s, b, groups, d]``, all
stored batch-major (``[b, s, n, d]`` memory: the layout attention kernels read contiguously).
The backward applies the inverse rotation to the incoming q/k gradients (any strides, as
attention backward returns them), copies the v gradient, and writes the packed
``[s, b, (heads + 2 * groups) * d]`` gradient in one pass: no concatenation.
``freqs`` may broadcast over the batch (stride 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotation(freqs_ptr, token, batch, f_stride_s, f_stride_b, cols, ROT: tl.constexpr):
    """cos/sin of the token's angle for each channel and of its rotate-half partner channel."""
    base = freqs_ptr + (token // batch) * f_stride_s + (token % batch) * f_stride_b
    rot = cols < ROT
    partner = tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2)
    angle = tl.load(base + cols, mask=rot, other=0.0).to(tl.float32)
    partner_angle = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
    return rot, partner, tl.cos(angle), tl.sin(angle), tl.sin(partner_angle)


@triton.jit
def _split_rotary_fwd_kernel(
    qkv_ptr,
    freqs_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    batch,
    f_stride_s,
    f_stride_b,
    out_stride_s,
    out_stride_b,
    HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    DIM: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    rot, partner, cos, sin, _ = _rotation(freqs_ptr, token, batch, f_stride_s, f_stride_b, cols, ROT)
    mask = (heads < HEADS + 2 * GROUPS) & (cols < DIM)
    row = qkv_ptr + token * (HEADS + 2 * GROUPS) * DIM + heads * DIM
    x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    rotated = rot & (heads < HEADS + GROUPS)  # v passes unrotated
    x_partner = tl.load(row + partner, mask=mask & rotated, other=0.0).to(tl.float32)
    x_partner = tl.where(cols < ROT // 2, -x_partner, x_partner)
    y = tl.where(rotated, x * cos + x_partner * sin, x).to(q_ptr.dtype.element_ty)
    # Outputs share the [s, b] strides (in elements per head of DIM: q has HEADS heads a token, k and v GROUPS).
    s_idx, b_idx = token // batch, token % batch
    q_out = q_ptr + (s_idx * out_stride_s + b_idx * out_stride_b) * HEADS * DIM + heads * DIM
    kv_token = (s_idx * out_stride_s + b_idx * out_stride_b) * GROUPS * DIM
    tl.store(q_out + cols, y, mask=mask & (heads < HEADS))
    k_out = k_ptr + kv_token + (heads - HEADS) * DIM
    tl.store(k_out + cols, y, mask=mask & (heads >= HEADS) & (heads < HEADS + GROUPS))
    v_out = v_ptr + kv_token + (heads - HEADS - GROUPS) * DIM
    tl.store(v_out + cols, y, mask=mask & (heads >= HEADS + GROUPS))


@triton.jit
def _split_rotary_bwd_kernel(
    dq_ptr,
    dk_ptr,
    dv_ptr,
    freqs_ptr,
    dqkv_ptr,
    batch,
    f_stride_s,
    f_stride_b,
    dq_s,
    dq_b,
    dq_h,
    dk_s,
    dk_b,
    dk_h,
    dv_s,
    dv_b,
    dv_h,
    HEADS: tl.constexpr,
    GROUPS: tl.constexpr,
    DIM: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    s_idx, b_idx = token // batch, token % batch
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    rot, partner, cos, _, partner_sin = _rotation(freqs_ptr, token, batch, f_stride_s, f_stride_b, cols, ROT)
    is_q = heads < HEADS
    mask = (heads < HEADS + GROUPS) & (cols < DIM)
    q_head = dq_ptr + s_idx * dq_s + b_idx * dq_b + heads * dq_h
    k_head = dk_ptr + s_idx * dk_s + b_idx * dk_b + (heads - HEADS) * dk_h
    g = tl.load(q_head + cols, mask=mask & is_q, other=0.0).to(tl.float32)
    g += tl.load(k_head + cols, mask=mask & (heads >= HEADS), other=0.0).to(tl.float32)
    g_partner = tl.load(q_head + partner, mask=mask & is_q & rot, other=0.0).to(tl.float32)
    g_partner += tl.load(k_head + partner, mask=mask & (heads >= HEADS) & rot, other=0.0).to(tl.float32)
    g_partner = tl.where(cols < ROT // 2, g_partner, -g_partner)
    dx = tl.where(rot, g * cos + g_partner * partner_sin, g)
    row = dqkv_ptr + token * (HEADS + 2 * GROUPS) * DIM
    tl.store(row + heads * DIM + cols, dx.to(dqkv_ptr.dtype.element_ty), mask=mask)
    v_mask = (heads < GROUPS) & (cols < DIM)
    dv = tl.load(dv_ptr + s_idx * dv_s + b_idx * dv_b + heads * dv_h + cols, mask=v_mask, other=0.0)
    tl.store(row + (HEADS + GROUPS) * DIM + heads * DIM + cols, dv.to(dqkv_ptr.dtype.element_ty), mask=v_mask)


def _blocks(heads: int, groups: int, head_dim: int) -> tuple[int, int, int]:
    block_h, block_d = triton.next_power_of_2(heads + 2 * groups), triton.next_power_of_2(head_dim)
    return block_h, block_d, min(max(block_h * block_d // 512, 1), 8)


def _freqs_strides(freqs: torch.Tensor, batch: int) -> tuple[int, int]:
    """Strides of ``freqs [s, b or 1, 1, rot]`` over sequence and batch (0 when broadcast)."""
    if freqs.stride(-1) != 1:
        raise ValueError(f"freqs must be contiguous in its last dim, got strides {freqs.stride()}")
    return freqs.stride(0), freqs.stride(1) if freqs.shape[1] == batch else 0


def split_rotary_forward(qkv, freqs, heads, groups, head_dim):
    """``(q, k, v)`` of :func:`megatron.core.fusions.rope.split_qkv`: new tensors of shape
    ``[s, b, n, d]`` stored batch-major (``[b, s, n, d]`` memory, as attention kernels read it);
    ``k`` and ``v`` are the two planes of one buffer (a paged KV cache stores both in one copy)."""
    qkv = qkv.contiguous()
    s, b, _ = qkv.shape

    def batch_major(*planes, n):
        return torch.empty(*planes, b, s, n, head_dim, device=qkv.device, dtype=qkv.dtype).transpose(-4, -3)

    q = batch_major(n=heads)
    k, v = batch_major(2, n=groups).unbind(0)
    block_h, block_d, warps = _blocks(heads, groups, head_dim)
    _split_rotary_fwd_kernel[(s * b,)](
        qkv,
        freqs,
        q,
        k,
        v,
        b,
        *_freqs_strides(freqs, b),
        q.stride(0) // (heads * head_dim),  # the outputs' [s, b] strides, in tokens
        q.stride(1) // (heads * head_dim),
        heads,
        groups,
        head_dim,
        freqs.shape[-1],
        block_h,
        block_d,
        num_warps=warps,
    )
    return q, k, v


def split_rotary_backward(dq, dk, dv, freqs, heads, groups, head_dim):
    """The packed ``[s, b, (heads + 2 * groups) * d]`` gradient of :func:`split_rotary_forward`."""
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    s, b = dq.shape[:2]
    dqkv = torch.empty(s, b, (heads + 2 * groups) * head_dim, device=dq.device, dtype=dq.dtype)
    block_h, block_d, warps = _blocks(heads, groups, head_dim)
    _split_rotary_bwd_kernel[(s * b,)](
        dq,
        dk,
        dv,
        freqs,
        dqkv,
        b,
        *_freqs_strides(freqs, b),
        *dq.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        heads,
        groups,
        head_dim,
        freqs.shape[-1],
        block_h,
        block_d,
        num_warps=warps,
    )
    return dqkv


class SplitRotaryFunction(torch.autograd.Function):
    """Autograd of the kernels: saves only ``freqs``."""

    @staticmethod
    def forward(ctx, qkv, freqs, heads, groups, head_dim):
        ctx.save_for_backward(freqs)
        ctx.sizes = heads, groups, head_dim
        return split_rotary_forward(qkv, freqs, heads, groups, head_dim)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        (freqs,) = ctx.saved_tensors
        return split_rotary_backward(dq, dk, dv, freqs, *ctx.sizes), None, None, None, None
