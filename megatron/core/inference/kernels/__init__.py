"""Batch-invariant kernels of the inference forward (see :mod:`mode`): the linear, the per-row
log-softmax, and the switch that turns the mode on and picks Triton or torch. Paged attention
(:mod:`megatron.core.inference.contexts.paged_attention`) and the Mamba recurrence
(:mod:`megatron.core.ssm.inference_triton`) are batch invariant by construction on every backend."""

from megatron.core.inference.kernels.linear import invariant_linear, torch_invariant_linear
from megatron.core.inference.kernels.log_softmax import log_softmax
from megatron.core.inference.kernels.mode import (
    BACKEND_ENV,
    BACKENDS,
    KernelBackendError,
    batch_invariant,
    is_batch_invariant,
    kernel_backend,
)

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "KernelBackendError",
    "batch_invariant",
    "invariant_linear",
    "is_batch_invariant",
    "kernel_backend",
    "log_softmax",
    "torch_invariant_linear",
]
