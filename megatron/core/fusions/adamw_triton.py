"""Triton kernel of :class:`megatron.core.optimizer.flat_adamw.FlatAdamW`: one AdamW update of
every tile of a flat buffer, and the write of the updated fp32 master into the model parameter's
low-precision copy in the same pass.

A tile is a row of the int64 table ``[grad offset, param offset, master offset, state offset,
elements, group]``: ``elements`` (at most ``BLOCK``) consecutive elements of one tensor, found at
those offsets from the bases of the gradient, model-parameter, master and state (``exp_avg`` /
``exp_avg_sq``) storages. ``coeffs`` holds one row per param group, computed on the device each
step: ``[lr / (1 - beta1^step), sqrt(1 - beta2^step), 1 - lr * weight_decay, beta1, beta2, eps]``.
The update is torch's AdamW in fp32 (``torch.optim.AdamW``, decoupled weight decay); the
gradient is divided by ``grad_scale`` when given, and nothing is written when ``found_inf`` is
non-zero (both one-element device tensors, so no host decision is needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 4096 fp32 elements a tile, 8 warps: 16 elements a thread per tensor, in 16-byte vectors when
# every offset and size is a multiple of ALIGNMENT (what DDP's buffers give for usual layer
# widths; otherwise Triton cannot prove the alignment and issues 4-byte accesses).
BLOCK, WARPS, ALIGNMENT = 4096, 8, 8


@triton.jit
def _adamw_kernel(
    tiles_ptr,
    grad_ptr,
    param_ptr,
    master_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    coeffs_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    HAS_COPY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tiles_ptr + tl.program_id(0).to(tl.int64) * 6
    grad_off, param_off = tl.load(row), tl.load(row + 1)
    master_off, state_off = tl.load(row + 2), tl.load(row + 3)
    if ALIGNED:
        grad_off = tl.multiple_of(grad_off, 8)
        param_off = tl.multiple_of(param_off, 8)
        master_off = tl.multiple_of(master_off, 8)
        state_off = tl.multiple_of(state_off, 8)
    count = tl.load(row + 4)
    coeffs = coeffs_ptr + tl.load(row + 5) * 6
    step_size, bias_correction2_sqrt = tl.load(coeffs), tl.load(coeffs + 1)
    decay, beta1, beta2, eps = tl.load(coeffs + 2), tl.load(coeffs + 3), tl.load(coeffs + 4), tl.load(coeffs + 5)
    if HAS_FOUND_INF:  # a skipped step touches nothing
        count = tl.where(tl.load(found_inf_ptr) == 0, count, 0)
    if ALIGNED:  # the mask is then constant over each 8-element vector
        count = tl.multiple_of(count, 8)
    index = tl.arange(0, BLOCK)
    mask = index < count
    grad = tl.load(grad_ptr + grad_off + index, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        grad = grad / tl.load(grad_scale_ptr)
    master = tl.load(master_ptr + master_off + index, mask=mask, other=0.0)
    exp_avg = tl.load(exp_avg_ptr + state_off + index, mask=mask, other=0.0)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + state_off + index, mask=mask, other=0.0)
    master = master * decay
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    master = master - step_size * exp_avg / denom
    tl.store(master_ptr + master_off + index, master, mask=mask)
    tl.store(exp_avg_ptr + state_off + index, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + state_off + index, exp_avg_sq, mask=mask)
    if HAS_COPY:
        tl.store(
            param_ptr + param_off + index, master.to(param_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask
        )


def adamw_step(tiles, grad, param, master, exp_avg, exp_avg_sq, coeffs, grad_scale, found_inf, aligned) -> None:
    """Launch one program per row of ``tiles`` over the flat bases (``param`` None: the masters
    are the model parameters, nothing to copy)."""
    _adamw_kernel[(tiles.shape[0],)](
        tiles,
        grad,
        param if param is not None else master,
        master,
        exp_avg,
        exp_avg_sq,
        coeffs,
        grad_scale,
        found_inf,
        param is not None,
        grad_scale is not None,
        found_inf is not None,
        aligned,
        BLOCK,
        num_warps=WARPS,
    )


def tile_tables(pieces: list[tuple[int, int, int, int, int, int]], device: torch.device) -> dict[bool, torch.Tensor]:
    """The int64 tile tables of ``pieces`` (``(grad offset, param offset, master offset, state
    offset, elements, group)`` each): every piece cut into tiles of at most ``BLOCK`` elements,
    by whether every offset and the size of a tile are multiples of ``ALIGNMENT`` (True: the
    launch with 16-byte accesses) or not; classes without tiles are left out."""
    columns = []
    for grad_off, param_off, master_off, state_off, numel, group in pieces:
        starts = torch.arange(0, numel, BLOCK, dtype=torch.int64)
        counts = torch.clamp(numel - starts, max=BLOCK)
        columns.append(
            torch.stack(
                [
                    grad_off + starts,
                    param_off + starts,
                    master_off + starts,
                    state_off + starts,
                    counts,
                    torch.full_like(starts, group),
                ],
                dim=1,
            )
        )
    table = torch.cat(columns)
    aligned = (table[:, :5] % ALIGNMENT == 0).all(dim=1)
    tables = {True: table[aligned], False: table[~aligned]}
    return {flag: rows.to(device) for flag, rows in tables.items() if rows.shape[0]}
