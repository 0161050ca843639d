"""Triton kernels of the Mamba-2 mixer's inference step over a packed batch of requests: the
causal conv (with its state) and the SSM recurrence, reading and updating the requests' state
slots in place.

A step packs R requests' new tokens as rows ``cu_query_lengths[r]:cu_query_lengths[r + 1]`` of
``xBC [T, channels]`` and ``dt [T, heads]`` (strided views of the in_proj output; rows past the
last request are padding); ``slot_ids [R]`` name each request's row of the slot tensors
``conv_slots [slots, channels, d_conv - 1]`` and ``ssm_slots [slots, heads, head_dim, d_state]``
(fp32; a negative id is a padding request, left alone). Everything the kernels need is read on
the device and the grids come from shapes, so a step is capturable in a CUDA graph.

1. ``_conv_kernel`` (one program per token and channel block): ``silu(bias + sum_k w_k x_{t-K+1+k})``
   with the inputs before the request's first new token taken from its conv state; then
   ``_conv_state_kernel`` (one program per request and channel block) moves the window to the
   last ``d_conv - 1`` inputs.
2. ``_ssm_kernel`` (one program per request, head and block of head_dim rows) walks the
   request's tokens in order with the state in registers:
   ``state = exp(dt A) state + dt x B^T``, ``y = state C + D x``, ``dt = softplus(dt + dt_bias)``.

Batch invariance: every token is computed by the same arithmetic in the same order whether it
is a decode token, one of a prefill chunk of any length, or recomputed after an eviction (the
state between steps is stored exactly, in fp32), and whatever else is in the step. This is the
recurrence the torch path (:meth:`MambaMixer._packed_step`) computes token by token; the chunked
scan (faster for long prompts) is not split invariant and serves the batch-variant mode.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONV_BLOCK_C = 256
SSM_BLOCK_P = 16


@triton.jit
def _conv_kernel(
    xbc_ptr,
    weight_ptr,
    bias_ptr,
    conv_slots_ptr,
    slot_ids_ptr,
    cu_ptr,
    out_ptr,
    num_requests,
    num_channels,
    stride_xt,
    stride_ot,
    stride_slot,
    stride_channel,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    REQ_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    # The token's request: how many requests end at or before it (a padding token finds none).
    req = tl.arange(0, REQ_PAD)
    ends = tl.load(cu_ptr + 1 + req, mask=req < num_requests, other=2147483647)
    request = tl.minimum(tl.sum((ends <= token).to(tl.int32), 0), num_requests - 1)
    start = tl.load(cu_ptr + request)
    end = tl.load(cu_ptr + request + 1)
    slot = tl.load(slot_ids_ptr + request)
    # Scalar conditions folded into vector bounds (the interpreter cannot mix them with masks).
    channel_ok = channels < tl.where((token < end) & (slot >= 0), num_channels, 0)
    acc = tl.load(bias_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    for k in tl.static_range(WIDTH):
        source = token - (WIDTH - 1) + k
        from_input = channels < tl.where(source >= start, num_channels, 0)
        from_state = channels < tl.where(source < start, num_channels, 0)
        x = tl.load(xbc_ptr + source.to(tl.int64) * stride_xt + channels, mask=channel_ok & from_input, other=0.0)
        history = tl.load(
            conv_slots_ptr + slot.to(tl.int64) * stride_slot + channels * stride_channel + (source - start + WIDTH - 1),
            mask=channel_ok & from_state,
            other=0.0,
        )
        w = tl.load(weight_ptr + channels * WIDTH + k, mask=channel_ok, other=0.0).to(tl.float32)
        acc += w * (x.to(tl.float32) + history)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + channels, out.to(out_ptr.dtype.element_ty), mask=channel_ok)


@triton.jit
def _conv_state_kernel(
    xbc_ptr,
    conv_slots_ptr,
    slot_ids_ptr,
    cu_ptr,
    num_channels,
    stride_xt,
    stride_slot,
    stride_channel,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    request = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(cu_ptr + request)
    end = tl.load(cu_ptr + request + 1)
    slot = tl.load(slot_ids_ptr + request)
    channel_ok = channels < tl.where(slot >= 0, num_channels, 0)
    state = conv_slots_ptr + slot.to(tl.int64) * stride_slot + channels * stride_channel
    # Column j becomes the input at end - (WIDTH - 1) + j: a new input, or old column j + n
    # (n = new tokens >= 1), read before this loop overwrites it (columns go in ascending order).
    for j in tl.static_range(WIDTH - 1):
        source = end - (WIDTH - 1) + j
        from_input = channels < tl.where(source >= start, num_channels, 0)
        from_state = channels < tl.where(source < start, num_channels, 0)
        x = tl.load(xbc_ptr + source.to(tl.int64) * stride_xt + channels, mask=channel_ok & from_input, other=0.0)
        old = tl.load(state + j + (end - start), mask=channel_ok & from_state, other=0.0)
        tl.store(state + j, x.to(tl.float32) + old, mask=channel_ok)


@triton.jit
def _ssm_kernel(
    xbc_ptr,
    dt_ptr,
    A_log_ptr,
    D_ptr,
    dt_bias_ptr,
    ssm_slots_ptr,
    slot_ids_ptr,
    cu_ptr,
    y_ptr,
    stride_xt,
    stride_dt,
    stride_yt,
    stride_slot,
    stride_head,
    stride_row,
    B_OFFSET,
    C_OFFSET,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_STATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    STATE_PAD: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, STATE_PAD)
    start = tl.load(cu_ptr + request)
    slot = tl.load(slot_ids_ptr + request)
    end = tl.where(slot >= 0, tl.load(cu_ptr + request + 1), start)
    row_ok = rows < HEAD_DIM
    col_ok = cols < D_STATE
    group = head // HEADS_PER_GROUP
    state_ptrs = ssm_slots_ptr + slot.to(tl.int64) * stride_slot + head * stride_head
    state_ptrs += rows[:, None] * stride_row + cols[None, :]
    tile_ok = (rows < tl.where(slot >= 0, HEAD_DIM, 0))[:, None] & col_ok[None, :]
    state = tl.load(state_ptrs, mask=tile_ok, other=0.0)
    A = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
    D = tl.load(D_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    x_cols = head * HEAD_DIM + rows
    b_cols = B_OFFSET + group * D_STATE + cols
    c_cols = C_OFFSET + group * D_STATE + cols
    for token in range(start, end):  # int64: the bounds are loaded from cu (int64)
        row = xbc_ptr + token * stride_xt
        x = tl.load(row + x_cols, mask=row_ok, other=0.0).to(tl.float32)
        B = tl.load(row + b_cols, mask=col_ok, other=0.0).to(tl.float32)
        C = tl.load(row + c_cols, mask=col_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + token * stride_dt + head).to(tl.float32) + dt_bias
        # softplus = log1p(exp(dt)) without libdevice (Kahan's log1p), dt past 20 kept
        u = tl.exp(tl.minimum(dt, 20.0))
        w = 1.0 + u
        dt = tl.where(dt > 20.0, dt, tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0)))
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
        y = tl.sum(state * C[None, :], 1) + D * x
        tl.store(y_ptr + token * stride_yt + x_cols, y.to(y_ptr.dtype.element_ty), mask=row_ok)
    tl.store(state_ptrs, state, mask=tile_ok)


def packed_recurrence(
    xBC: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_slots: torch.Tensor,
    ssm_slots: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_query_lengths: torch.Tensor,
    ngroups: int,
) -> torch.Tensor:
    """Conv + SSM recurrence of a packed step (see module doc), updating the slots in place.

    Args:
        xBC: ``[T, channels]`` in_proj output part ``x|B|C`` (row stride free, channel stride 1).
        dt: ``[T, heads]`` raw time steps (before ``dt_bias`` and softplus).
        conv_weight ``[channels, 1, d_conv]``, conv_bias ``[channels]``, A_log, D and dt_bias
        ``[heads]`` (the decay rate is ``A = -exp(A_log)``): the TP-local mixer parameters.
        conv_slots, ssm_slots, slot_ids, cu_query_lengths: as in the module doc.
        ngroups: TP-local B/C groups.
    Returns:
        ``y [T, heads * head_dim]`` in xBC's dtype (0 for padding rows), the gated norm's input.
    """
    num_tokens, channels = xBC.shape
    num_slots, heads, head_dim, d_state = ssm_slots.shape
    width = conv_weight.shape[-1]
    num_requests = slot_ids.shape[0]
    if xBC.stride(-1) != 1 or dt.stride(-1) != 1:
        raise ValueError("packed_recurrence reads xBC and dt with channel stride 1")
    if conv_slots.shape[1:] != (channels, width - 1) or conv_slots.stride(-1) != 1 or not ssm_slots.is_contiguous():
        raise ValueError(
            f"conv slots must be [slots, {channels}, {width - 1}] with unit last stride and SSM slots contiguous, "
            f"got {tuple(conv_slots.shape)} and {tuple(ssm_slots.shape)}"
        )
    cu_query_lengths = cu_query_lengths.to(torch.int64)
    y = torch.zeros(num_tokens, heads * head_dim, dtype=xBC.dtype, device=xBC.device)
    if num_tokens == 0 or num_requests == 0:
        return y
    conv_out = torch.empty(num_tokens, channels, dtype=xBC.dtype, device=xBC.device)  # padding rows unread
    conv_weight = conv_weight.reshape(channels, width).contiguous()
    channel_blocks = triton.cdiv(channels, CONV_BLOCK_C)
    _conv_kernel[(num_tokens, channel_blocks)](
        xBC,
        conv_weight,
        conv_bias,
        conv_slots,
        slot_ids,
        cu_query_lengths,
        conv_out,
        num_requests,
        channels,
        xBC.stride(0),
        conv_out.stride(0),
        conv_slots.stride(0),
        conv_slots.stride(1),
        WIDTH=width,
        BLOCK_C=CONV_BLOCK_C,
        REQ_PAD=max(64, triton.next_power_of_2(num_requests)),  # few variants to compile
    )
    _conv_state_kernel[(num_requests, channel_blocks)](
        xBC,
        conv_slots,
        slot_ids,
        cu_query_lengths,
        channels,
        xBC.stride(0),
        conv_slots.stride(0),
        conv_slots.stride(1),
        WIDTH=width,
        BLOCK_C=CONV_BLOCK_C,
    )
    b_offset = heads * head_dim
    _ssm_kernel[(num_requests, heads, triton.cdiv(head_dim, SSM_BLOCK_P))](
        conv_out,
        dt,
        A_log,
        D,
        dt_bias,
        ssm_slots,
        slot_ids,
        cu_query_lengths,
        y,
        conv_out.stride(0),
        dt.stride(0),
        y.stride(0),
        ssm_slots.stride(0),
        ssm_slots.stride(1),
        ssm_slots.stride(2),
        b_offset,
        b_offset + ngroups * d_state,
        HEADS_PER_GROUP=heads // ngroups,
        HEAD_DIM=head_dim,
        D_STATE=d_state,
        BLOCK_P=SSM_BLOCK_P,
        STATE_PAD=triton.next_power_of_2(d_state),
    )
    return y
