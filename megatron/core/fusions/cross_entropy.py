"""Per-token cross-entropy over logits whose vocabulary is split across TP ranks, on the fused
backend switch: the Triton path (:mod:`cross_entropy_triton`) reads the logits in their own
dtype and never builds an fp32 copy of them (the math is fp32 in registers, the backward
recomputes the softmax per row from a saved log-sum-exp and overwrites the logits with their
gradient); the torch path is :func:`megatron.core.tensor_parallel.vocab_parallel_cross_entropy`
on the logits cast to fp32 (or not, with ``upcast=False``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.fusions.backend import fused_backend, needs_autograd
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as reference_cross_entropy
from megatron.core.tensor_parallel.utils import TensorParallelError


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp_group, upcast: bool = True
) -> torch.Tensor:
    """Loss ``-log softmax(logits)[target]`` per token, fp32, identical on every TP rank.

    Args:
        logits: ``[..., V/tp]``, this rank's slice of the vocabulary (ids ``[r*V/tp, (r+1)*V/tp)``).
        target: ``[...]`` global token ids.
        tp_group: the group the vocabulary is split over.
        upcast: the torch path computes in fp32 (else in the logits' dtype); the Triton path
            always computes in fp32. With autograd, the Triton path reuses the logits' storage
            for their gradient: they must not be read after backward.
    """
    if fused_backend("cross_entropy", logits.device) == "torch":
        return reference_cross_entropy(logits.float() if upcast else logits, target, tp_group)
    if logits.shape[:-1] != target.shape:
        raise TensorParallelError(
            f"logits shape {tuple(logits.shape)} must be target shape {tuple(target.shape)} plus a vocabulary dim"
        )
    from megatron.core.fusions.cross_entropy_triton import (
        VocabParallelCrossEntropyFunction,
        log_sum_exp_and_target,
    )

    local_vocab = logits.shape[-1]
    start = dist.get_rank(tp_group) * local_vocab
    local_target = target - start
    local_target = local_target.masked_fill((local_target < 0) | (local_target >= local_vocab), -1)
    if needs_autograd(logits):
        return VocabParallelCrossEntropyFunction.apply(logits, local_target, tp_group)
    rows = logits.reshape(-1, local_vocab).contiguous()
    lse, target_logit = log_sum_exp_and_target(rows, local_target.reshape(-1), tp_group)
    return (lse - target_logit).view(target.shape)
