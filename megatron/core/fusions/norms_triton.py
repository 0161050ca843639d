"""Triton kernels of :mod:`megatron.core.fusions.norms`: residual add, bias, dropout and
LayerNorm/RMSNorm in one pass over the rows.

Forward, one program per row of ``n`` channels: ``sum = residual + dropout(x + bias)`` (each part
optional), rounded to the activation dtype and stored, then ``normed = norm(sum) * w (+ b)``
from the rounded ``sum`` (so the normalized value is exactly the stored residual stream), with
fp32 statistics. Backward, a fixed grid of programs each walking a contiguous range of rows:
the norm's input gradient plus the gradient that reaches ``sum`` from its other consumers, the
dropout mask regenerated from the seed (never stored), and per-program fp32 partial sums of the
weight/bias gradients, added up by one small reduction afterwards.

Dropout uses Triton's Philox generator keyed by a one-element seed tensor and the element's
flat index (as int32, the counter width every Triton version takes; masks repeat only past 2^32
elements), so a mask costs no memory and the call has no host synchronization (CUDA graph
capturable). Under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _add_norm_fwd_kernel(
    x_ptr,
    bias_ptr,
    residual_ptr,
    seed_ptr,
    weight_ptr,
    norm_bias_ptr,
    sum_ptr,
    out_ptr,
    mean_ptr,
    rstd_ptr,
    n_cols,
    eps,
    p,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_SUM: tl.constexpr,
    DO_NORM: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = tl.rand(tl.load(seed_ptr), offs.to(tl.int32)) >= p
        x = tl.where(keep, x / (1.0 - p), 0.0)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if STORE_SUM:
        rounded = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, rounded, mask=mask)
        x = rounded.to(tl.float32)
    if DO_NORM:
        if IS_RMS:
            centered = x
        else:
            mean = tl.sum(x, axis=0) / n_cols
            tl.store(mean_ptr + row, mean)
            centered = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd)
        y = centered * rstd * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM_BIAS:
            y += tl.load(norm_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_norm_bwd_kernel(
    dout_ptr,
    dsum_ptr,
    s_ptr,
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    seed_ptr,
    ds_ptr,
    dx_ptr,
    dweight_ptr,
    dnorm_bias_ptr,
    dbias_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    p,
    DO_NORM: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr,
    HAS_DSUM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if DO_NORM:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    acc_dw = tl.zeros([BLOCK], dtype=tl.float32)
    acc_dnb = tl.zeros([BLOCK], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        row_ok = row < n_rows
        m = cols < tl.where(row_ok, n_cols, 0)
        offs = row * n_cols + cols
        ds = tl.zeros([BLOCK], dtype=tl.float32)
        if DO_NORM:
            dy = tl.load(dout_ptr + offs, mask=m, other=0.0).to(tl.float32)
            s = tl.load(s_ptr + offs, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
            if IS_RMS:
                xhat = s * rstd
            else:
                xhat = tl.where(m, (s - tl.load(mean_ptr + row, mask=row_ok, other=0.0)) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / n_cols
            if IS_RMS:
                ds = (wdy - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdy, axis=0) / n_cols
                ds = (wdy - (xhat * c1 + c2)) * rstd
            acc_dw += dy * xhat
            if HAS_NORM_BIAS:
                acc_dnb += dy
        if HAS_DSUM:
            ds += tl.load(dsum_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(ds_ptr + offs, ds.to(ds_ptr.dtype.element_ty), mask=m)
        dx = ds
        if HAS_DROPOUT:
            keep = tl.rand(tl.load(seed_ptr), offs.to(tl.int32)) >= p
            dx = tl.where(keep, ds / (1.0 - p), 0.0)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
        if HAS_BIAS:
            acc_db += dx
    partial = pid.to(tl.int64) * n_cols + cols
    if DO_NORM:
        tl.store(dweight_ptr + partial, acc_dw, mask=mask)
        if HAS_NORM_BIAS:
            tl.store(dnorm_bias_ptr + partial, acc_dnb, mask=mask)
    if HAS_BIAS:
        tl.store(dbias_ptr + partial, acc_db, mask=mask)


def _block_and_warps(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, min(max(block // 256, 1), 16)


@functools.lru_cache(maxsize=8)
def program_count(device: torch.device, per_sm: int = 4) -> int:
    """Programs of a backward grid: ``per_sm`` per SM on CUDA (one wave, good balance); a handful
    on the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def add_norm_forward(x, bias, residual, seed, p, weight, norm_bias, eps, is_rms, do_norm):
    """Forward kernel on 2-D ``[rows, n]`` contiguous tensors; returns ``(sum or None, out or
    None, mean or None, rstd or None)``. ``sum`` is stored when anything is added to ``x``."""
    rows, n_cols = x.shape
    store_sum = bias is not None or residual is not None or seed is not None
    summed = torch.empty_like(x) if store_sum else None
    out = torch.empty_like(x) if do_norm else None
    mean = torch.empty(rows, device=x.device, dtype=torch.float32) if do_norm and not is_rms else None
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32) if do_norm else None
    block, warps = _block_and_warps(n_cols)
    _add_norm_fwd_kernel[(rows,)](
        x,
        bias,
        residual,
        seed,
        weight,
        norm_bias,
        summed,
        out,
        mean,
        rstd,
        n_cols,
        eps,
        p,
        HAS_BIAS=bias is not None,
        HAS_DROPOUT=seed is not None,
        HAS_RESIDUAL=residual is not None,
        STORE_SUM=store_sum,
        DO_NORM=do_norm,
        IS_RMS=is_rms,
        HAS_NORM_BIAS=norm_bias is not None,
        BLOCK=block,
        num_warps=warps,
    )
    return summed, out, mean, rstd


def add_norm_backward(dout, dsum, s, weight, mean, rstd, seed, p, has_norm_bias, has_bias, is_rms, do_norm):
    """Backward kernel; returns ``(d_sum, d_x, d_weight, d_norm_bias, d_bias)`` (``d_x`` is
    ``d_sum`` itself without dropout; weight/bias grads None where absent)."""
    ref = dout if dout is not None else dsum
    rows, n_cols = ref.shape
    programs = max(1, min(rows, program_count(ref.device)))
    rows_per_program = max(1, triton.cdiv(rows, programs))
    programs = max(1, triton.cdiv(rows, rows_per_program))
    ds = torch.empty_like(ref)
    dx = torch.empty_like(ref) if seed is not None else ds

    def partial(flag):
        return torch.empty(programs, n_cols, device=ref.device, dtype=torch.float32) if flag else None

    dweight, dnorm_bias, dbias = partial(do_norm), partial(do_norm and has_norm_bias), partial(has_bias)
    block, warps = _block_and_warps(n_cols)
    _add_norm_bwd_kernel[(programs,)](
        dout,
        dsum,
        s,
        weight,
        mean,
        rstd,
        seed,
        ds,
        dx,
        dweight,
        dnorm_bias,
        dbias,
        rows,
        n_cols,
        rows_per_program,
        p,
        DO_NORM=do_norm,
        IS_RMS=is_rms,
        HAS_NORM_BIAS=dnorm_bias is not None,
        HAS_DSUM=dsum is not None,
        HAS_DROPOUT=seed is not None,
        HAS_BIAS=has_bias,
        BLOCK=block,
        num_warps=warps,
    )

    def total(buffer, like):
        return None if buffer is None else buffer.sum(0).to(like.dtype)

    return ds, dx, total(dweight, weight if do_norm else ref), total(dnorm_bias, ref), total(dbias, ref)


class AddNormFunction(torch.autograd.Function):
    """``(sum, normed) = (residual + dropout(x + bias), norm(sum))`` with the kernels above.

    Tensors are 2-D ``[rows, n]`` and contiguous; ``bias``, ``residual``, ``seed`` and
    ``norm_bias`` may be None; ``do_norm=False`` gives bias-dropout-add alone (``normed`` None).
    Without anything to add the normalized input is ``x`` itself and ``sum`` is None.
    """

    @staticmethod
    def forward(ctx, x, bias, residual, weight, norm_bias, seed, p, eps, is_rms, do_norm):
        summed, out, mean, rstd = add_norm_forward(x, bias, residual, seed, p, weight, norm_bias, eps, is_rms, do_norm)
        ctx.save_for_backward(summed if summed is not None else x, weight, mean, rstd, seed)
        ctx.flags = (p, bias is not None, residual is not None, norm_bias is not None, is_rms, do_norm)
        return summed, out

    @staticmethod
    def backward(ctx, dsum, dout):
        # Autograd materializes zeros for unused outputs; a None is the grad of a None output.
        s, weight, mean, rstd, seed = ctx.saved_tensors
        p, has_bias, has_residual, has_norm_bias, is_rms, do_norm = ctx.flags
        if not do_norm and seed is None:  # bias + residual add: the gradient passes through
            dbias = dsum.sum(0).to(dsum.dtype) if has_bias else None
            return dsum, dbias, dsum, None, None, None, None, None, None, None
        ds, dx, dweight, dnorm_bias, dbias = add_norm_backward(
            dout.contiguous() if do_norm else None,
            None if dsum is None else dsum.contiguous(),
            s,
            weight,
            mean,
            rstd,
            seed,
            p,
            has_norm_bias,
            has_bias,
            is_rms,
            do_norm,
        )
        return dx, dbias, ds if has_residual else None, dweight, dnorm_bias, None, None, None, None, None


class NormWithResidualFunction(torch.autograd.Function):
    """``(x, norm(x))`` where ``x`` also feeds the residual add of a pre-norm sub-block: the
    backward receives both gradients of ``x`` at once and one kernel adds the residual's to the
    norm's input gradient (``d_sum`` of :func:`add_norm_backward`), instead of autograd summing
    the two in a separate pass. Tensors are 2-D ``[rows, n]`` and contiguous."""

    @staticmethod
    def forward(ctx, x, weight, norm_bias, eps, is_rms):
        _, out, mean, rstd = add_norm_forward(x, None, None, None, 0.0, weight, norm_bias, eps, is_rms, True)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.flags = norm_bias is not None, is_rms
        ctx.set_materialize_grads(False)  # an unused residual adds nothing (no zeros read)
        return x, out  # x returned as is: autograd makes it a view with this node as its grad_fn

    @staticmethod
    def backward(ctx, d_residual, d_out):
        x, weight, mean, rstd = ctx.saved_tensors
        has_norm_bias, is_rms = ctx.flags
        d_out = torch.zeros_like(x) if d_out is None else d_out.contiguous()
        dsum = None if d_residual is None else d_residual.contiguous()
        ds, _, dweight, dnorm_bias, _ = add_norm_backward(
            d_out, dsum, x, weight, mean, rstd, None, 0.0, has_norm_bias, False, is_rms, True
        )
        return ds, dweight, dnorm_bias, None, None
