"""The backend switch of the fused ops: Triton kernels on CUDA, the torch reference elsewhere.

Every op of :mod:`megatron.core.fusions` asks :func:`fused_backend` which implementation to run
for its tensors:

- ``"auto"`` (the default): Triton on CUDA tensors when Triton imports, else torch;
- ``"torch"``: the reference path everywhere (the CPU path and the oracle of the tests);
- ``"triton"``: the kernels; on CPU tensors only under Triton's interpreter
  (``TRITON_INTERPRET=1``, how the unit tests run them), otherwise a :class:`FusionBackendError`.

The backend comes from :func:`set_fusion_backend` (or the :func:`fusion_backend` context
manager), else from the :data:`BACKEND_ENV` environment variable, else ``"auto"``. Single ops can
be sent back to torch (e.g. a kernel a GPU self-check found broken) with ``disabled_ops``.
Inside ``torch.compile`` every op takes the torch path, so Inductor fuses it with its neighbours.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megatron.core.errors import MegatronConfigError
from megatron.core.triton_support import triton_importable, triton_runs_on

BACKENDS = ("auto", "torch", "triton")
BACKEND_ENV = "MEGATRON_FUSION_BACKEND"
# The fused ops, by the names disabled_ops takes. "linear_bias" is a column-parallel linear's
# bias added by the GEMM (cuBLAS epilogue) rather than by a separate add; "linear_cross_entropy"
# the output layer's GEMM and the loss in one chunked op (the logits never materialized); "adamw"
# the optimizer step over DDP's flat buffers (megatron.core.optimizer.flat_adamw).
FUSED_OPS = (
    "norm",
    "bias_dropout_add",
    "activation",
    "rope",
    "cross_entropy",
    "linear_bias",
    "linear_cross_entropy",
    "adamw",
)


class FusionBackendError(MegatronConfigError):
    """An unknown backend or op name, or Triton asked for where it cannot run."""


_settings = {"backend": None, "disabled_ops": frozenset()}


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise FusionBackendError(
            f"fusion backend {name!r} is unknown; accepted: {', '.join(BACKENDS)} (argument or {BACKEND_ENV})"
        )
    return name


def set_fusion_backend(backend: str | None = None, disabled_ops=()) -> None:
    """Choose the backend of every fused op (``None``: the environment variable, else auto) and
    the ops that always take the torch path."""
    if backend is not None:
        _check_backend(backend)
    unknown = sorted(set(disabled_ops) - set(FUSED_OPS))
    if unknown:
        raise FusionBackendError(f"unknown fused ops {unknown}; the fused ops are {', '.join(FUSED_OPS)}")
    _settings["backend"] = backend
    _settings["disabled_ops"] = frozenset(disabled_ops)


@contextlib.contextmanager
def fusion_backend(backend: str | None = None, disabled_ops=()):
    """:func:`set_fusion_backend` for the enclosed block, restoring the previous choice."""
    previous = dict(_settings)
    set_fusion_backend(backend, disabled_ops)
    try:
        yield
    finally:
        _settings.update(previous)


def disabled_ops() -> frozenset[str]:
    """The fused ops that always take the torch path (:func:`set_fusion_backend`'s ``disabled_ops``)."""
    return _settings["disabled_ops"]


def requested_backend() -> str:
    """The backend asked for, before looking at any device: the setting, the environment, auto."""
    if _settings["backend"] is not None:
        return _settings["backend"]
    return _check_backend(os.environ.get(BACKEND_ENV, "auto") or "auto")


def fused_backend(op: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"``: the implementation ``op`` runs for tensors on ``device``."""
    if op not in FUSED_OPS:
        raise FusionBackendError(f"unknown fused op {op!r}; the fused ops are {', '.join(FUSED_OPS)}")
    backend = requested_backend()
    if backend == "torch" or op in _settings["disabled_ops"] or torch.compiler.is_compiling():
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if not triton_importable():
        raise FusionBackendError("fusion backend 'triton' was forced but triton does not import; use 'torch'")
    if not triton_runs_on(device):
        raise FusionBackendError(
            f"fusion backend 'triton' needs CUDA tensors (got {device}) or Triton's interpreter "
            "(TRITON_INTERPRET=1 before triton is imported); use 'torch' or 'auto'"
        )
    return "triton"


def needs_autograd(*tensors) -> bool:
    """Whether a call must record a graph (grad mode on and some input requires grad); a
    forward-only call (``no_grad``, ``inference_mode``) runs the bare kernels."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
