"""The Mamba-2 mixer's other sequence ops in plain torch: causal depthwise conv + SiLU, gated RMSNorm.

Like :mod:`ssd_reference`, these are the CPU path and the oracle the Triton kernels of
:mod:`conv1d_triton` and :mod:`gated_norm_triton` are checked against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Elements per row that any CPU elementwise loop covers in whole vector chunks (2 x 16 fp32 lanes
# on AVX-512, fewer elsewhere).
ROW_INVARIANT_WIDTH = 64


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` of ``x [..., n]``, each row's bits independent of the
    number of rows. torch's CPU loops compute the elements past a tensor's last whole vector chunk
    with scalar code, which rounds softplus or SiLU differently from the vector code; a row padded
    to a multiple of :data:`ROW_INVARIANT_WIDTH` elements is never in that tail. Other devices get
    ``fn(x)`` (their kernels compute every element alike)."""
    width = x.shape[-1]
    pad = -width % ROW_INVARIANT_WIDTH
    if x.device.type != "cpu" or not pad:
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., :width]


def causal_conv1d_silu(
    xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, conv_state: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(bias[c] + sum_k weight[c, 0, k] * xBC[b, t - (K - 1) + k, c])`` over ``xBC [b, s, c]``.

    ``conv_state [b, c, K - 1]`` holds the inputs before the first token (zeros when None: a
    fresh sequence) and is advanced in place to the last ``K - 1`` inputs (history included, so
    a prefill shorter than the window keeps the older inputs). Returns ``[b, s, c]`` in xBC's dtype.
    """
    batch, _, channels = xBC.shape
    width = weight.shape[-1]
    history = conv_state.to(xBC.dtype) if conv_state is not None else xBC.new_zeros(batch, channels, width - 1)
    window = torch.cat([history, xBC.transpose(1, 2)], dim=-1)  # [b, c, K - 1 + s]
    if conv_state is not None:
        conv_state.copy_(window[..., window.shape[-1] - (width - 1) :])
    return F.silu(F.conv1d(window, weight, bias, groups=channels)).transpose(1, 2)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """``weight * rmsnorm(x * silu(gate))`` with the statistic taken per group of ``group_size``
    channels (NemotronH / Mamba-2 ``norm_before_gate=False``). fp32 inside; returns x's dtype
    (times the weight's)."""
    gated = x.float() * F.silu(gate.float())
    grouped = gated.unflatten(-1, (-1, group_size))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.flatten(-2).to(x.dtype)
