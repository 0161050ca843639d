"""LayerNorm / RMSNorm, bias-dropout-add, and the two fused (the residual add feeding the next
norm; a sub-block's norm whose input is also its residual, the two gradients added in the
norm's backward): the torch reference and the dispatch to the Triton kernels of :mod:`norms_triton`.

``kind`` is ``"LayerNorm"`` or ``"RMSNorm"`` (``TransformerConfig.normalization``). The Triton
path computes in fp32 and rounds once, so on bf16 it agrees with the reference (which rounds
after every op) to bf16 precision, not bitwise; on the torch path results are exactly those of
the plain ops. Bias-dropout-add is ``residual + dropout(x + bias)``, its mask drawn from the
RNG stream matching the activation's sharding (:mod:`megatron.core.fusions.dropout`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.fusions.backend import fused_backend, needs_autograd
from megatron.core.fusions.dropout import dropout, dropout_seed


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """LayerNorm over the last dim, computed in the input dtype."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: the statistic in fp32, the weight applied in the input dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _norm_reference(x, weight, bias, eps, kind):
    return rms_norm_reference(x, weight, eps) if kind == "RMSNorm" else layer_norm_reference(x, weight, bias, eps)


def bias_dropout_add_reference(x, bias, residual, p, training, sharded_over_tp=False):
    if bias is not None:
        x = x + bias
    return residual + dropout(x, p, training, sharded_over_tp)


def _triton_ready(*tensors) -> bool:
    """The kernels take one dtype for every tensor (mixed dtypes take the reference)."""
    present = [t for t in tensors if t is not None]
    return all(t.dtype == present[0].dtype for t in present)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as contiguous ``[rows, n]``, the kernels' layout."""
    return None if t is None else t.reshape(-1, t.shape[-1]).contiguous()


def _add_norm_triton(x, bias, residual, p, training, sharded_over_tp, weight, norm_bias, eps, kind, do_norm):
    from megatron.core.fusions.norms_triton import AddNormFunction, add_norm_forward

    p = p if training else 0.0
    seed = dropout_seed(x.device, sharded_over_tp) if p > 0.0 else None
    norm_bias = norm_bias if do_norm else None
    args = (_rows(x), bias, _rows(residual), weight, norm_bias, seed, p, eps, kind == "RMSNorm", do_norm)
    if needs_autograd(x, bias, residual, weight, norm_bias):
        summed, out = AddNormFunction.apply(*args)
    else:
        x2, bias, res2, weight, norm_bias, seed, p, eps, is_rms, do_norm = args
        summed, out, _, _ = add_norm_forward(x2, bias, res2, seed, p, weight, norm_bias, eps, is_rms, do_norm)
    return tuple(None if t is None else t.view(x.shape) for t in (summed, out))


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, kind: str) -> torch.Tensor:
    """``kind`` norm of ``x`` over its last dim with ``weight`` (and ``bias``, LayerNorm only)."""
    if fused_backend("norm", x.device) == "torch" or not _triton_ready(x, weight, bias):
        return _norm_reference(x, weight, bias, eps, kind)
    return _add_norm_triton(x, None, None, 0.0, False, False, weight, bias, eps, kind, do_norm=True)[1]


def norm_and_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, norm(x))`` for a pre-norm sub-block, whose input is both the norm's input and the
    residual of its closing add: use the first as that residual. On the Triton path the backward
    adds the residual's gradient to the norm's input gradient in the norm's backward kernel; the
    torch path is ``x`` itself and :func:`norm`."""
    if (
        fused_backend("norm", x.device) == "torch"
        or not _triton_ready(x, weight, bias)
        or not needs_autograd(x, weight, bias)
    ):
        return x, norm(x, weight, bias, eps, kind)
    from megatron.core.fusions.norms_triton import NormWithResidualFunction

    residual, out = NormWithResidualFunction.apply(_rows(x), weight, bias, eps, kind == "RMSNorm")
    return residual.view(x.shape), out.view(x.shape)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    sharded_over_tp: bool = False,
) -> torch.Tensor:
    """``residual + dropout(x + bias)`` (``bias`` may be None; dropout only when training)."""
    if fused_backend("bias_dropout_add", x.device) == "torch" or not _triton_ready(x, bias, residual):
        return bias_dropout_add_reference(x, bias, residual, p, training, sharded_over_tp)
    return _add_norm_triton(x, bias, residual, p, training, sharded_over_tp, None, None, 0.0, "RMSNorm", False)[0]


def bias_dropout_add_norm(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    sharded_over_tp: bool,
    weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    eps: float,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, norm(h))`` with ``h = residual + dropout(x + bias)``: a sub-block's residual add and
    the next sub-block's norm in one pass."""
    if fused_backend("norm", x.device) == "torch" or not _triton_ready(x, bias, residual, weight, norm_bias):
        summed = bias_dropout_add_reference(x, bias, residual, p, training, sharded_over_tp)
        return summed, _norm_reference(summed, weight, norm_bias, eps, kind)
    return _add_norm_triton(x, bias, residual, p, training, sharded_over_tp, weight, norm_bias, eps, kind, True)
