"""The single-sub-block layers of a hybrid stack besides Mamba: ``*`` attention and ``-`` MLP.

Each is ``h + dropout(block(norm(h)) + bias)``, like :class:`megatron.core.ssm.mamba_layer.MambaLayer`,
and reuses the transformer's SelfAttention / MLP modules. All layers of a hybrid stack share
one forward signature: ``(hidden, attention_mask=None, rotary_pos_emb=None,
inference_context=None) -> hidden``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.fusions.norms import bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import mlp_forward


def _bias_dropout_add(config: TransformerConfig, training: bool, out, bias, residual: torch.Tensor) -> torch.Tensor:
    return bias_dropout_add(out, bias, residual, config.hidden_dropout, training, config.sequence_parallel)


@dataclass
class AttentionLayerSubmodules:
    norm: Any = build_norm
    self_attention: Any = field(
        default_factory=lambda: ModuleSpec(module=SelfAttention, submodules=SelfAttentionSubmodules())
    )


class AttentionLayer(nn.Module):
    """``h + attention(norm(h))``; ``layer_number`` is global and 1-based."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: AttentionLayerSubmodules | None = None,
        layer_number: int = 1,
        pg_collection=None,
    ):
        super().__init__()
        submodules = submodules or AttentionLayerSubmodules()
        self.config = config
        self.layer_number = layer_number
        self.norm = build_module(submodules.norm, config, config.hidden_size)
        self.self_attention = build_module(
            submodules.self_attention, config=config, layer_number=layer_number, pg_collection=pg_collection
        )

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        residual, normed = self.norm.norm_and_residual(hidden_states)
        out, bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            inference_context=inference_context,
        )
        return _bias_dropout_add(self.config, self.training, out, bias, residual)


@dataclass
class MLPLayerSubmodules:
    norm: Any = build_norm
    mlp: Any = field(default_factory=lambda: ModuleSpec(module=MLP, submodules=MLPSubmodules()))


class MLPLayer(nn.Module):
    """``h + mlp(norm(h))``; masks, rotary embeddings and inference contexts do not concern it."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPLayerSubmodules | None = None,
        layer_number: int = 1,
        pg_collection=None,
    ):
        super().__init__()
        submodules = submodules or MLPLayerSubmodules()
        self.config = config
        self.layer_number = layer_number
        self.norm = build_module(submodules.norm, config, config.hidden_size)
        self.mlp = build_module(submodules.mlp, config=config, pg_collection=pg_collection)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        residual, normed = self.norm.norm_and_residual(hidden_states)
        out, bias = mlp_forward(self.mlp, normed)
        return _bias_dropout_add(self.config, self.training, out, bias, residual)
