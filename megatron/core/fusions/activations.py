"""The MLP activation with fc1's bias: ``act(x + bias)``, or gated ``act(gate) * up`` over the
packed ``[gate | up]`` halves of the last dim (SwiGLU when ``act`` is SiLU).

Backends (see :mod:`megatron.core.fusions.backend`):

- triton: :mod:`activations_triton`, bias, activation and gate in one pass each way, for GELU
  (erf or tanh) and SiLU;
- torch: the plain ops. Gated, the backward writes the gate and up gradients straight into
  the halves of one buffer instead of concatenating them (the CPU cost of ``chunk``); the values
  are exactly those of autograd through ``chunk``, ``act`` and ``*``.

Other activation functions always take the plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.activations import gelu_tanh
from megatron.core.fusions.backend import fused_backend, needs_autograd

# Activation function -> (name of its kernel, aten backward with its keyword arguments).
_FUSABLE = {
    F.gelu: ("gelu", torch.ops.aten.gelu_backward, {"approximate": "none"}),
    gelu_tanh: ("gelu_tanh", torch.ops.aten.gelu_backward, {"approximate": "tanh"}),
    F.silu: ("silu", torch.ops.aten.silu_backward, {}),
}


def activation_reference(x: torch.Tensor, bias: torch.Tensor | None, func, gated: bool) -> torch.Tensor:
    """The plain ops: the oracle of the fused paths."""
    if bias is not None:
        x = x + bias
    if gated:
        gate, up = x.chunk(2, dim=-1)
        return func(gate) * up
    return func(x)


class _GatedTorch(torch.autograd.Function):
    """``func(gate) * up`` whose backward fills the two halves of one gradient buffer."""

    @staticmethod
    def forward(ctx, x, func, func_backward, backward_kwargs):
        gate, up = x.chunk(2, dim=-1)
        activated = func(gate)
        ctx.save_for_backward(gate, up, activated)
        ctx.func_backward, ctx.backward_kwargs = func_backward, backward_kwargs
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        gate, up, activated = ctx.saved_tensors
        dx = grad.new_empty(*grad.shape[:-1], 2 * grad.shape[-1])
        d_gate, d_up = dx.chunk(2, dim=-1)
        torch.mul(grad, activated, out=d_up)
        torch.mul(grad, up, out=d_gate)  # the activation's incoming gradient, then its own in place
        ctx.func_backward(d_gate, gate, **ctx.backward_kwargs, grad_input=d_gate)
        return dx, None, None, None


def activation(x: torch.Tensor, bias: torch.Tensor | None, func, gated: bool) -> torch.Tensor:
    """``func(x + bias)`` (``bias`` may be None); gated: ``func(gate) * up`` of the biased ``x``."""
    fusable = _FUSABLE.get(func)
    if fusable is None or torch.compiler.is_compiling():  # compiled: Inductor fuses the plain ops
        return activation_reference(x, bias, func, gated)
    name, func_backward, backward_kwargs = fusable
    if fused_backend("activation", x.device) == "torch" or (bias is not None and bias.dtype != x.dtype):
        if not gated or not needs_autograd(x, bias):
            return activation_reference(x, bias, func, gated)
        if bias is not None:
            x = x + bias
        return _GatedTorch.apply(x, func, func_backward.grad_input, backward_kwargs)
    from megatron.core.fusions.activations_triton import ActivationFunction, activation_forward

    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if needs_autograd(x, bias):
        out = ActivationFunction.apply(rows, bias, name, gated)
    else:
        out = activation_forward(rows, bias, name, gated)
    return out.view(*x.shape[:-1], out.shape[-1])
