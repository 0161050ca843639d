"""The Mamba-2 mixer's sequence path on CUDA in one autograd Function: conv + SiLU, SSD scan,
gated RMSNorm, between the in_proj and out_proj GEMMs.

Passes over memory (``zxbcdt [s, b, z|x|B|C|dt]`` is the in_proj output, sequence-major):

- forward: the conv kernel reads x|B|C out of zxbcdt and writes ``xBC [s, b, c]`` once;
  mamba-ssm's chunked scan reads x, dt, B, C through strided views (dt straight from zxbcdt)
  and writes ``y [b, s, d]``; the gated-norm kernel reads y and z (from zxbcdt) and writes the
  out_proj input ``[s, b, d]`` contiguous. No split, transpose or dtype copy.
- backward: one gradient buffer ``dzxbcdt`` like zxbcdt; the norm backward writes dz into it,
  the scan backward writes ddt into it and dx|dB|dC into one ``dxBC`` buffer, and the conv
  backward reads dxBC and writes dxBC_in into it. No ``cat`` of split gradients.

Saved for backward: zxbcdt, xBC and y (the scan backward recomputes its own chunk states).
The scan's passes come from mamba-ssm (``_mamba_chunk_scan_combined_fwd`` / ``_bwd``, the
functions its own fused split-conv path is built on); they take preallocated gradient views,
which is what lets the gradients land in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from megatron.core.ssm.conv1d_triton import conv1d_silu_backward, conv1d_silu_forward
from megatron.core.ssm.gated_norm_triton import gated_rms_norm_backward, gated_rms_norm_forward

if TYPE_CHECKING:
    from megatron.core.ssm.backends import MixerWeights
    from megatron.core.ssm.mamba_mixer import MambaDims


class ScanPasses(NamedTuple):
    """mamba-ssm's chunked-scan forward and backward passes (see module doc)."""

    forward: Callable
    backward: Callable


def _land(given: torch.Tensor, returned: torch.Tensor) -> None:
    """The scan backward writes into the views it is given; copy if a version ever returns a new tensor."""
    if returned.data_ptr() != given.data_ptr():
        given.copy_(returned)


class _ConvScanNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, dims, chunk_size, eps, scan):
        seqlen, batch, _ = zxbcdt.shape
        z, xBC, dt = dims.split_in_proj(zxbcdt.transpose(0, 1))  # [b, s, ...] views
        xBC_conv = conv1d_silu_forward(xBC, conv_weight, conv_bias)  # sequence-major, like zxbcdt
        x, B, C = dims.split_conv(xBC_conv)
        y = scan.forward(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True)[0].flatten(-2)
        out = torch.empty(seqlen, batch, y.shape[-1], dtype=y.dtype, device=y.device)
        gated_rms_norm_forward(y.transpose(0, 1), z.transpose(0, 1), norm_weight, dims.norm_group_size, eps, out=out)
        ctx.save_for_backward(zxbcdt, xBC_conv, y, conv_weight, conv_bias, A, D, dt_bias, norm_weight)
        ctx.dims, ctx.chunk_size, ctx.eps, ctx.scan = dims, chunk_size, eps, scan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        zxbcdt, xBC_conv, y, conv_weight, conv_bias, A, D, dt_bias, norm_weight = ctx.saved_tensors
        dims = ctx.dims
        z, xBC, dt = dims.split_in_proj(zxbcdt.transpose(0, 1))
        grad_zxbcdt = torch.empty_like(zxbcdt)
        dz, dxBC_in, ddt = dims.split_in_proj(grad_zxbcdt.transpose(0, 1))
        dy = torch.empty_like(y)
        _, _, grad_norm_weight = gated_rms_norm_backward(
            y.transpose(0, 1),
            z.transpose(0, 1),
            norm_weight,
            grad_out,
            dims.norm_group_size,
            ctx.eps,
            grad_x=dy.transpose(0, 1),
            grad_gate=dz.transpose(0, 1),
        )
        x, B, C = dims.split_conv(xBC_conv)
        dxBC = torch.empty_like(xBC_conv)
        dx, dB, dC = dims.split_conv(dxBC)
        head_dim = x.shape[-1]
        got_dx, got_ddt, dA, got_dB, got_dC, dD, _, ddt_bias, _ = ctx.scan.backward(
            dy.unflatten(-1, (-1, head_dim)),
            x,
            dt,
            A,
            B,
            C,
            y.unflatten(-1, (-1, head_dim)),
            ctx.chunk_size,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            dx=dx,
            ddt=ddt,
            dB=dB,
            dC=dC,
        )
        for given, returned in ((dx, got_dx), (ddt, got_ddt), (dB, got_dB), (dC, got_dC)):
            _land(given, returned)
        _, grad_conv_weight, grad_conv_bias = conv1d_silu_backward(xBC, conv_weight, conv_bias, dxBC, grad_x=dxBC_in)
        return (
            grad_zxbcdt,
            grad_conv_weight,
            grad_conv_bias,
            dA,
            dD.to(D.dtype),
            ddt_bias.to(dt_bias.dtype),
            grad_norm_weight,
            None,
            None,
            None,
            None,
        )


def conv_scan_norm(
    zxbcdt: torch.Tensor, weights: MixerWeights, dims: MambaDims, chunk_size: int, eps: float, scan: ScanPasses
) -> torch.Tensor:
    """``gated_norm(scan(silu(conv(xBC))), z)`` of the in_proj output ``zxbcdt [s, b, local]``:
    the out_proj input ``[s, b, d_inner_local]`` (contiguous), differentiable in zxbcdt and every
    weight. The same function as :meth:`TorchSSMBackend.mix`, to bf16 rounding."""
    return _ConvScanNorm.apply(
        zxbcdt,
        weights.conv_weight,
        weights.conv_bias,
        weights.A,
        weights.D,
        weights.dt_bias,
        weights.norm_weight,
        dims,
        chunk_size,
        eps,
        scan,
    )
