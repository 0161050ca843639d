"""Kernel switch for the Mamba-2 mixer: Triton kernels (mamba-ssm's scan, our conv and gated
norm) on CUDA, plain torch elsewhere.

Both backends take the raw ``dt`` (before ``dt_bias`` and softplus) and the same shapes, so
the mixer never branches on the backend:

- ``mix(zxbcdt [s,b,local], weights, dims, chunk_size, eps) -> [s,b,d_inner_local]``: the whole
  sequence path between in_proj and out_proj for a fresh sequence (training): conv + SiLU,
  scan, gated RMSNorm. The Triton backend runs it as one autograd Function
  (:mod:`mixer_triton`) with the fewest passes over memory.
- ``chunk_scan(x [b,l,h,p], dt [b,l,h], A [h], B/C [b,l,g,n], chunk_size, D [h], dt_bias [h],
  initial_state [b,h,p,n] | None) -> (y [b,l,h,p], final_state [b,h,p,n])`` (prefill from states)
- ``state_update(ssm_state [b,h,p,n], x [b,h,p], dt [b,h], A, B/C [b,g,n], D, dt_bias) -> y [b,h,p]``,
  advancing ``ssm_state`` in place (decode).
- ``token_recurrence(x [G,h,p], dt [G,h], A, B/C [G,g,n], D, dt_bias, ssm [R,h,p,n], calls,
  active) -> (y [G,h,p], final [active[0],h,p,n])``: a prefill run token by token, the one-token
  updates of ``G`` tokens a call at a time (call ``j`` advances the first rows of ``ssm`` by the
  tokens ``calls[j]``, a slice; ``active[j]`` of them real), every token's output and each real
  row's state after its last real call; ``ssm`` holds the working states (the torch backend
  leaves it as it was). Row for row it gives the bits of ``state_update`` on those tokens.

The chunk size is the scan's blocking, not part of the function: the Triton scan uses chunks of
at least :data:`TRITON_MIN_CHUNK_SIZE` tokens (:func:`triton_chunk_size`; tensor-core tiles, where
the small config default suits the CPU reference), which changes results only by rounding.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from megatron.core.errors import MegatronConfigError
from megatron.core.ssm.mixer_reference import causal_conv1d_silu, gated_rms_norm, rowwise
from megatron.core.ssm.ssd_reference import (
    rows_left,
    ssd_advance,
    ssd_chunked_scan,
    ssd_recurrence,
    ssd_step_factors,
)

if TYPE_CHECKING:
    from megatron.core.ssm.mamba_mixer import MambaDims
    from megatron.core.ssm.mixer_triton import ScanPasses

BACKEND_NAMES = ("auto", "torch", "triton")
TRITON_MIN_CHUNK_SIZE = 128


def triton_chunk_size(chunk_size: int) -> int:
    """The chunk length the Triton scan uses for a configured ``mamba_chunk_size``."""
    return max(chunk_size, TRITON_MIN_CHUNK_SIZE)


class MixerWeights(NamedTuple):
    """The TP-local mixer parameters the sequence path reads between in_proj and out_proj."""

    conv_weight: torch.Tensor  # [c, 1, d_conv]
    conv_bias: torch.Tensor  # [c]
    A_log: torch.Tensor  # [h]
    D: torch.Tensor  # [h]
    dt_bias: torch.Tensor  # [h]
    norm_weight: torch.Tensor  # [d_inner]

    @property
    def A(self) -> torch.Tensor:
        """The (negative) fp32 decay rates ``-exp(A_log)``."""
        return -torch.exp(self.A_log.float())


class SSMBackendError(MegatronConfigError):
    """An unknown backend name, or the Triton backend asked for where it cannot run."""


class TorchSSMBackend:
    """The reference path of :mod:`megatron.core.ssm.ssd_reference` (any device, autograd)."""

    name = "torch"

    def mix(self, zxbcdt, weights: MixerWeights, dims: MambaDims, chunk_size: int, eps: float):
        z, xBC, dt = dims.split_in_proj(zxbcdt.transpose(0, 1))  # [b, s, ...]: the scan wants batch first
        x, B, C = dims.split_conv(causal_conv1d_silu(xBC, weights.conv_weight, weights.conv_bias))
        y, _ = self.chunk_scan(x, dt, weights.A, B, C, chunk_size, weights.D, weights.dt_bias)
        return gated_rms_norm(y.flatten(-2), z, weights.norm_weight, dims.norm_group_size, eps).transpose(0, 1)

    @staticmethod
    def chunk_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state=None):
        step = F.softplus(dt.float() + dt_bias.float())
        return ssd_chunked_scan(x, step, A, B, C, chunk_size, D, initial_state)

    @staticmethod
    def state_update(ssm_state, x, dt, A, B, C, D, dt_bias):
        y, new_state = ssd_advance(ssm_state, TorchSSMBackend._factors(x, dt, A, B, C, D, dt_bias))
        ssm_state.copy_(new_state)
        return y

    @staticmethod
    def token_recurrence(x, dt, A, B, C, D, dt_bias, ssm, calls, active):
        # The factors of every token at once (their ops are row invariant), then per call only the
        # recurrence over the rows it takes.
        return ssd_recurrence(ssm, TorchSSMBackend._factors(x, dt, A, B, C, D, dt_bias), calls, active)

    @staticmethod
    def _factors(x, dt, A, B, C, D, dt_bias):
        step = rowwise(F.softplus, dt.float() + dt_bias.float())  # decode rows batch invariant
        return ssd_step_factors(x, step, A, B, C, D)


class _MambaKernels(NamedTuple):
    chunk_scan_combined: Callable
    selective_state_update: Callable
    scan: ScanPasses  # mamba-ssm's chunked-scan forward and backward passes
    conv_scan_norm: Callable  # mixer_triton.conv_scan_norm


class TritonSSMBackend:
    """mamba-ssm's chunked scan and ``selective_state_update``, and the fused sequence path of
    :mod:`mixer_triton` (CUDA only)."""

    name = "triton"

    def __init__(self, kernels: _MambaKernels):
        self._kernels = kernels

    def mix(self, zxbcdt, weights: MixerWeights, dims: MambaDims, chunk_size: int, eps: float):
        chunk = triton_chunk_size(chunk_size)
        return self._kernels.conv_scan_norm(zxbcdt, weights, dims, chunk, eps, self._kernels.scan)

    def chunk_scan(self, x, dt, A, B, C, chunk_size, D, dt_bias, initial_state=None):
        return self._kernels.chunk_scan_combined(
            x,
            dt,
            A,
            B,
            C,
            triton_chunk_size(chunk_size),
            D=D,
            z=None,
            dt_bias=dt_bias,
            initial_states=initial_state,
            dt_softplus=True,
            return_final_states=True,
        )

    def token_recurrence(self, x, dt, A, B, C, D, dt_bias, ssm, calls, active):
        y = x.new_empty(x.shape)
        final = ssm.new_empty(active[0] if active else 0, *ssm.shape[1:])
        for call, left, count in zip(calls, rows_left(active), active, strict=True):
            rows = ssm[: call.stop - call.start]
            y[call] = self.state_update(rows, x[call], dt[call], A, B[call], C[call], D, dt_bias)
            final[left:count] = ssm[left:count]
        return y, final

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
    """Import mamba-ssm's Triton kernels and ours, or return None when CUDA, Triton or mamba-ssm is missing.

    ``mamba_ssm/__init__`` imports its compiled ``selective_scan_cuda`` extension, which we
    never call and which is often not built; a stub module lets the Triton kernels import.
    Our kernel modules are imported here, not at the top: Triton decorates kernels at import,
    and tests choose its interpreter before that.
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
        from mamba_ssm.ops.triton.ssd_combined import (
            _mamba_chunk_scan_combined_bwd,
            _mamba_chunk_scan_combined_fwd,
            mamba_chunk_scan_combined,
        )

        from megatron.core.ssm.mixer_triton import ScanPasses, conv_scan_norm
    except (ImportError, OSError, RuntimeError):
        if stubbed:
            del sys.modules["selective_scan_cuda"]
        return None
    scan = ScanPasses(_mamba_chunk_scan_combined_fwd, _mamba_chunk_scan_combined_bwd)
    return _MambaKernels(mamba_chunk_scan_combined, selective_state_update, scan, conv_scan_norm)


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
