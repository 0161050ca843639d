"""Per-row fp32 log-softmax for log-probs, batch invariant on every backend: the Triton kernel of
:mod:`log_softmax_triton` (one program per row), or torch's CPU kernel (it also computes each
row on its own). Top-k of the result is a selection (``torch.topk``): exact, so invariant too."""

from __future__ import annotations

import torch

from megatron.core.inference.kernels.mode import kernel_backend


def log_softmax(logits: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """fp32 ``log_softmax`` over the last axis of ``logits [rows, vocab]``."""
    if kernel_backend(logits.device, backend) == "triton":
        from megatron.core.inference.kernels.log_softmax_triton import triton_log_softmax

        return triton_log_softmax(logits)
    return torch.log_softmax(logits.float(), dim=-1)
