"""LayerNorm and RMSNorm over the hidden dimension, picked by ``config.normalization``.

Norm weights are replicated on every TP and GTP rank. Under sequence parallelism each TP
rank normalizes only its slice of the sequence, so the weight gradients are partial and
carry ``sequence_parallel = True`` (finalize_model_grads all-reduces them over ``tp``).

The math is :mod:`megatron.core.fusions.norms` (fused Triton kernels on CUDA, the torch
reference elsewhere); :meth:`add_and_norm` also takes in the residual add that precedes the norm.

With ``config.layernorm_zero_centered_gamma`` the stored weight is the offset from 1 (it
starts at 0 and weight decay pulls it towards an identity scale), Megatron's
``--apply-layernorm-1p``.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.fusions.norms import bias_dropout_add_norm, norm, norm_and_residual
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


class _Norm(nn.Module):
    """The forward of both norms; a subclass names its ``kind`` and holds ``weight`` (and ``bias``)
    and ``zero_centered_gamma``."""

    kind: str

    def scale(self) -> torch.Tensor:
        """The multiplier the norm applies: its weight, or 1 + weight when zero-centered."""
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x, self.scale(), getattr(self, "bias", None), self.eps, self.kind)

    def norm_and_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, self(x))``: the first is the sub-block's residual (its gradient is added to the
        norm's input gradient in one backward kernel on the fused path)."""
        return norm_and_residual(x, self.scale(), getattr(self, "bias", None), self.eps, self.kind)

    def add_and_norm(
        self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, config: TransformerConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, self(h))`` for ``h = residual + dropout(x + bias)`` (``config.hidden_dropout``,
        when training; the mask is sequence-sharded under sequence parallelism), in one pass."""
        return bias_dropout_add_norm(
            x,
            bias,
            residual,
            config.hidden_dropout,
            self.training,
            config.sequence_parallel,
            self.scale(),
            getattr(self, "bias", None),
            self.eps,
            self.kind,
        )


class LayerNorm(_Norm):
    """Standard LayerNorm (weight and bias), computed in the input dtype."""

    kind = "LayerNorm"

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None):
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = _norm_weight(config, hidden_size)
        self.bias = mark_replicated(
            nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)), config.sequence_parallel
        )


class RMSNorm(_Norm):
    """Root-mean-square norm (weight only); the statistic is computed in fp32."""

    kind = "RMSNorm"

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None):
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = _norm_weight(config, hidden_size)


NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


def build_norm(config: TransformerConfig, hidden_size: int | None = None, eps: float | None = None) -> nn.Module:
    """The norm named by ``config.normalization`` over ``hidden_size`` (default: the model width).

    ``config.normalization`` is validated by TransformerConfig ("LayerNorm" or "RMSNorm").
    """
    return NORMS[config.normalization](config, config.hidden_size if hidden_size is None else hidden_size, eps)
