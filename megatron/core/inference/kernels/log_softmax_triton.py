"""Per-row log-softmax in Triton: one program per row, the vocabulary walked in tiles of a width
fixed by the row length, fp32 statistics.

A row's result depends only on that row (no reduction split by the number of rows, as torch's
CUDA reductions may do for few rows), so log-probs are batch invariant. Two passes: an online
max / sum of exponentials kept per lane, then ``x - logsumexp`` written out. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it also runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE = 4096


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], -float("inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # A lane that has seen only -inf keeps max -inf and sum 0 (no inf - inf).
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(x - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    safe_row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    total = tl.sum(lane_sum * tl.exp(lane_max - safe_row_max), axis=0)
    log_normalizer = safe_row_max + tl.log(total)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, x - log_normalizer, mask=ok)


def triton_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``log_softmax(logits, dim=-1)`` of ``logits [rows, n]`` (any float dtype)."""
    if logits.dim() != 2:
        raise ValueError(f"log_softmax takes logits [rows, vocab], got shape {tuple(logits.shape)}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, n_cols = logits.shape
    out = torch.empty(rows, n_cols, dtype=torch.float32, device=logits.device)
    if rows == 0 or n_cols == 0:
        return out
    block = min(MAX_TILE, triton.next_power_of_2(n_cols))
    _log_softmax_kernel[(rows,)](
        logits, out, n_cols, logits.stride(0), out.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4
    )
    return out
