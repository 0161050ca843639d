"""LayerNorm and RMSNorm over the hidden dimension, picked by ``config.normalization``.

Norm weights are replicated on every TP and GTP rank. Under sequence parallelism each TP
rank normalizes only its slice of the sequence, so the weight gradients are partial and
carry ``sequence_parallel = True`` (finalize_model_grads all-reduces them over ``tp``).

With ``config.layernorm_zero_centered_gamma`` the stored weight is the offset from 1 (it
starts at 0 and weight decay pulls it towards an identity scale), Megatron's
``--apply-layernorm-1p``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.tensor_parallel import set_parallel_attributes


def mark_replicated(param: nn.Parameter, sequence_parallel: bool = False) -> nn.Parameter:
    """Set the sharding attributes of a parameter that every TP/GTP rank holds whole."""
    set_parallel_attributes(
        param,
        tensor_model_parallel=False,
        partition_dim=-1,
        global_shape=param.shape,
        sequence_parallel=sequence_parallel,
    )
    return param


def _norm_weight(config: TransformerConfig, hidden_size: int) -> nn.Parameter:
    fill = torch.zeros if config.layernorm_zero_centered_gamma else torch.ones
    return mark_replicated(nn.Parameter(fill(hidden_size, dtype=config.params_dtype)), config.sequence_parallel)


def _scale(module: nn.Module) -> torch.Tensor:
    """The multiplier the norm applies: its weight, or 1 + weight when zero-centered."""
    return module.weight + 1 if module.zero_centered_gamma else module.weight


class LayerNorm(nn.Module):
    """Standard LayerNorm (weight and bias), computed in the input dtype."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None):
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = _norm_weight(config, hidden_size)
        self.bias = mark_replicated(
            nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)), config.sequence_parallel
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), _scale(self), self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm (weight only); the statistic is computed in fp32."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None):
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = _norm_weight(config, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return _scale(self) * normed.to(x.dtype)


NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


def build_norm(config: TransformerConfig, hidden_size: int | None = None, eps: float | None = None) -> nn.Module:
    """The norm named by ``config.normalization`` over ``hidden_size`` (default: the model width).

    ``config.normalization`` is validated by TransformerConfig ("LayerNorm" or "RMSNorm").
    """
    return NORMS[config.normalization](config, config.hidden_size if hidden_size is None else hidden_size, eps)
