"""Kernel switch for the Mamba-2 scan: mamba-ssm Triton kernels on CUDA, plain torch elsewhere.

Both backends take the raw ``dt`` (before ``dt_bias`` and softplus) and the same shapes, so
the mixer never branches on the backend:

- ``chunk_scan(x [b,l,h,p], dt [b,l,h], A [h], B/C [b,l,g,n], chunk_size, D [h], dt_bias [h],
  initial_state [b,h,p,n] | None) -> (y [b,l,h,p], final_state [b,h,p,n])``
- ``state_update(ssm_state [b,h,p,n], x [b,h,p], dt [b,h], A, B/C [b,g,n], D, dt_bias) -> y [b,h,p]``,
  advancing ``ssm_state`` in place.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron.core.errors import MegatronConfigError
from megatron.core.ssm.ssd_reference import ssd_chunked_scan, ssd_step

BACKEND_NAMES = ("auto", "torch", "triton")


class SSMBackendError(MegatronConfigError):
    """An unknown backend name, or the Triton backend asked for where it cannot run."""


class TorchSSMBackend:
    """The reference path of :mod:`megatron.core.ssm.ssd_reference` (any device, autograd)."""

    name = "torch"

    @staticmethod
    def chunk_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state=None):
        step = F.softplus(dt.float() + dt_bias.float())
        return ssd_chunked_scan(x, step, A, B, C, chunk_size, D, initial_state)

    @staticmethod
    def state_update(ssm_state, x, dt, A, B, C, D, dt_bias):
        step = F.softplus(dt.float() + dt_bias.float())
        y, new_state = ssd_step(ssm_state, x, step, A, B, C, D)
        ssm_state.copy_(new_state)
        return y


class _MambaKernels(NamedTuple):
    chunk_scan_combined: Callable
    selective_state_update: Callable


class TritonSSMBackend:
    """mamba-ssm's ``mamba_chunk_scan_combined`` and ``selective_state_update`` (CUDA only)."""

    name = "triton"

    def __init__(self, kernels: _MambaKernels):
        self._kernels = kernels

    def chunk_scan(self, x, dt, A, B, C, chunk_size, D, dt_bias, initial_state=None):
        return self._kernels.chunk_scan_combined(
            x,
            dt,
            A,
            B,
            C,
            chunk_size,
            D=D,
            z=None,
            dt_bias=dt_bias,
            initial_states=initial_state,
            dt_softplus=True,
            return_final_states=True,
        )

    def state_update(self, ssm_state, x, dt, A, B, C, D, dt_bias):
        head_dim, d_state = ssm_state.shape[-2:]
        # The kernel takes per-channel dt/A/D/dt_bias; Mamba-2 shares them across a head.
        return self._kernels.selective_state_update(
            ssm_state,
            x,
            dt.unsqueeze(-1).expand(-1, -1, head_dim),
            A[:, None, None].expand(-1, head_dim, d_state),
            B,
            C,
            D=D[:, None].expand(-1, head_dim),
            z=None,
            dt_bias=dt_bias[:, None].expand(-1, head_dim),
            dt_softplus=True,
        )


@functools.cache
def load_mamba_kernels() -> _MambaKernels | None:
    """Import mamba-ssm's Triton kernels, or return None when CUDA or the package is missing.

    ``mamba_ssm/__init__`` imports its compiled ``selective_scan_cuda`` extension, which we
    never call and which is often not built; a stub module lets the Triton kernels import.
    """
    if not torch.cuda.is_available():
        return None
    stubbed = False
    try:
        import selective_scan_cuda  # noqa: F401
    except ImportError:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
        stubbed = True
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except (ImportError, OSError, RuntimeError):
        if stubbed:
            del sys.modules["selective_scan_cuda"]
        return None
    return _MambaKernels(mamba_chunk_scan_combined, selective_state_update)


def get_ssm_backend(device: torch.device, name: str = "auto") -> TorchSSMBackend | TritonSSMBackend:
    """The scan backend for tensors on ``device``.

    ``"auto"`` picks Triton on CUDA when mamba-ssm imports, else torch; ``"torch"`` always
    gives the reference; ``"triton"`` raises SSMBackendError where it cannot run.
    """
    if name not in BACKEND_NAMES:
        raise SSMBackendError(f"unknown SSM backend {name!r}; accepted: {', '.join(BACKEND_NAMES)}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchSSMBackend()
    kernels = load_mamba_kernels() if device.type == "cuda" else None
    if kernels is not None:
        return TritonSSMBackend(kernels)
    if name == "triton":
        raise SSMBackendError(
            f"SSM backend 'triton' needs CUDA tensors and an importable mamba_ssm package "
            f"(tensors are on {device}, mamba_ssm kernels {'did not import' if device.type == 'cuda' else 'unused'}); "
            "use 'torch' or 'auto'"
        )
    return TorchSSMBackend()
