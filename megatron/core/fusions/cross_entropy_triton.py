"""Triton kernels of :func:`megatron.core.fusions.cross_entropy.vocab_parallel_cross_entropy`.

The logits stay in their own dtype (bf16 on GPU): no fp32 copy of ``[tokens, V/tp]`` is ever
made. Forward, one program per token row walks the local vocabulary in tiles with an online
max / sum-exp in fp32 registers and picks the target's logit when the target falls in this
rank's slice; the per-row statistics (a few floats per token) are combined over the TP group
(``MAX`` of the maxima, then one ``SUM`` of the rescaled sum-exp and target logits). Only the
logits and the per-token log-sum-exp are kept for backward, which recomputes the softmax tile
by tile and writes ``(softmax - onehot) * grad`` over the logits in place: their storage
becomes their gradient (the logits must not be read after backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _ce_stats_kernel(
    logits_ptr, target_ptr, max_ptr, sumexp_ptr, target_logit_ptr, n_vocab, row_stride, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    running_max = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, n_vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, x)
        # A lane that has seen only -inf (padding) keeps a zero sum, without computing inf - inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.exp(x - safe_max)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    row_sum = tl.sum(running_sum * tl.exp(running_max - row_max), axis=0)
    target = tl.load(target_ptr + row)
    inside = (target >= 0) & (target < n_vocab)
    target_logit = tl.load(base + tl.where(inside, target, 0)).to(tl.float32)
    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, row_sum)
    tl.store(target_logit_ptr + row, tl.where(inside, target_logit, 0.0))


@triton.jit
def _ce_grad_kernel(logits_ptr, target_ptr, lse_ptr, grad_ptr, n_vocab, row_stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < n_vocab
    ptrs = logits_ptr + row * row_stride + cols
    x = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    softmax = tl.exp(x - tl.load(lse_ptr + row))
    onehot = tl.where(cols == tl.load(target_ptr + row), 1.0, 0.0)
    grad = (softmax - onehot) * tl.load(grad_ptr + row)
    tl.store(ptrs, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _launch_stats(rows: torch.Tensor, local_target: torch.Tensor):
    n_rows, n_vocab = rows.shape
    row_max, sumexp, target_logit = (torch.empty(n_rows, device=rows.device, dtype=torch.float32) for _ in range(3))
    _ce_stats_kernel[(n_rows,)](
        rows, local_target, row_max, sumexp, target_logit, n_vocab, rows.stride(0), BLOCK_V, num_warps=8
    )
    return row_max, sumexp, target_logit


def log_sum_exp_and_target(rows: torch.Tensor, local_target: torch.Tensor, tp_group):
    """Per row: log-sum-exp of the logits over the whole (TP-split) vocabulary and the target's
    logit (found on the one rank whose slice holds it), both fp32."""
    row_max, sumexp, target_logit = _launch_stats(rows, local_target)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        both = torch.stack([sumexp * torch.exp(row_max - global_max), target_logit])
        dist.all_reduce(both, group=tp_group)
        sumexp, target_logit, row_max = both[0], both[1], global_max
    return torch.log(sumexp) + row_max, target_logit


def softmax_grad_in_place(rows: torch.Tensor, local_target: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor):
    """Overwrite ``rows`` (the logits) with ``(softmax - onehot) * grad_loss``."""
    n_rows, n_vocab = rows.shape
    _ce_grad_kernel[(n_rows, triton.cdiv(n_vocab, BLOCK_V))](
        rows, local_target, lse, grad_loss, n_vocab, rows.stride(0), BLOCK_V, num_warps=8
    )
    return rows


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """``loss[t] = lse[t] - logits[t, target[t]]`` over a TP-split vocabulary; see the module."""

    @staticmethod
    def forward(ctx, logits, local_target, tp_group):
        rows = logits.reshape(-1, logits.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        target = local_target.reshape(-1)
        lse, target_logit = log_sum_exp_and_target(rows, target, tp_group)
        ctx.save_for_backward(rows, target, lse)
        ctx.logits_shape = logits.shape
        return (lse - target_logit).view(local_target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        rows, target, lse = ctx.saved_tensors
        grad = softmax_grad_in_place(rows, target, lse, grad_loss.reshape(-1).float().contiguous())
        return grad.view(ctx.logits_shape), None, None
