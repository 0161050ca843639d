"""The batch-invariant mode of the inference forward and the switch between its two backends.

In batch-invariant mode every op of the forward computes a row (a token) in an order that
depends only on that row: the linears (:func:`~megatron.core.inference.kernels.linear.invariant_linear`),
the per-row log-softmax, paged attention and the Mamba recurrence. A request's logits then do not
depend on what it is batched with, nor on how many padding rows a step carries, so steps may be
padded to a few bucket sizes (CUDA-graph friendly) instead of one fixed maximum.

The engine turns the mode on around its forward (``with batch_invariant(True): ...``); it is a
context variable, so engines in different threads do not see each other's setting, and it is off
outside (training never sees it).

Backends of the invariant ops: ``"triton"`` (the kernels of this package; on CUDA, or on CPU under
Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the unit tests run them) and
``"torch"`` (CPU reference paths with the same invariance, by fixed-shape calls). ``"auto"``, the
default, picks Triton on CUDA when it imports, else torch; the :data:`BACKEND_ENV` environment
variable or :func:`kernel_backend`'s argument forces one.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

from megatron.core.errors import MegatronConfigError
from megatron.core.triton_support import triton_importable, triton_runs_on

BACKENDS = ("auto", "torch", "triton")
BACKEND_ENV = "MEGATRON_INFERENCE_KERNEL_BACKEND"

_batch_invariant = contextvars.ContextVar("megatron_batch_invariant", default=False)


class KernelBackendError(MegatronConfigError):
    """An unknown inference-kernel backend, or Triton asked for where it cannot run."""


def is_batch_invariant() -> bool:
    """Whether the forward being run must be batch invariant (see module doc). Never inside
    ``torch.compile`` (training's compiled layers): reading the context variable there would
    break the graph, and the engine's forward is not compiled."""
    if torch.compiler.is_compiling():
        return False
    return _batch_invariant.get()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Run the enclosed forward in batch-invariant mode (or explicitly not, ``enabled=False``)."""
    token = _batch_invariant.set(bool(enabled))
    try:
        yield
    finally:
        _batch_invariant.reset(token)


def kernel_backend(device: torch.device, backend: str = "auto") -> str:
    """``"torch"`` or ``"triton"``: the implementation of the invariant ops for tensors on
    ``device``. An explicit ``backend`` wins, then :data:`BACKEND_ENV`, then auto."""
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if backend not in BACKENDS:
        raise KernelBackendError(
            f"inference kernel backend {backend!r} is unknown; accepted: {', '.join(BACKENDS)} "
            f"(argument or {BACKEND_ENV})"
        )
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if backend == "triton":
        if not triton_importable():
            raise KernelBackendError("inference kernel backend 'triton' was forced but triton does not import")
        if not triton_runs_on(device):
            raise KernelBackendError(
                f"inference kernel backend 'triton' needs CUDA tensors (got {device}) or Triton's interpreter "
                "(TRITON_INTERPRET=1 before triton is imported); use 'torch' or 'auto'"
            )
    return backend
