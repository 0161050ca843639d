"""Cross-entropy over logits whose vocabulary dimension is split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import TensorParallelError, vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local_vocab = logits.shape[-1]
        start, end = vocab_range(local_vocab * world, rank, world)
        logits_dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # shifted is this function's own tensor; only the gather above read it
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = logits_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The saved softmax becomes the gradient in place (no copy of [tokens, V/tp]); a second
        # backward through the same graph fails autograd's saved-tensor version check.
        grad, local_target, outside = ctx.saved_tensors
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token cross-entropy ``-log softmax(logits)[target]`` computed in fp32.

    Args:
        logits: ``[s, b, V/tp]``, this rank's slice of the vocabulary (rank r holds ids
            ``[r*V/tp, (r+1)*V/tp)``).
        target: ``[s, b]`` global token ids.
        tp_group: the tensor-parallel process group the vocabulary is split over.
    Returns: loss ``[s, b]`` (fp32), identical on every TP rank.
    """
    if logits.shape[:-1] != target.shape:
        raise TensorParallelError(
            f"logits shape {tuple(logits.shape)} must be target shape {tuple(target.shape)} plus a vocabulary dim"
        )
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
