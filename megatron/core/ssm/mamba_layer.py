"""One Mamba layer of a hybrid stack: pre-norm, Mamba-2 mixer, dropout, residual add."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.dropout import dropout
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import build_module


@dataclass
class MambaLayerSubmodules:
    """What builds the norm (called as ``norm(config, hidden_size)``) and the mixer
    (``mixer(config, layer_number=..., pg_collection=...)``)."""

    norm: Any = build_norm
    mixer: Any = MambaMixer


class MambaLayer(nn.Module):
    """``h + dropout(mixer(norm(h)))`` on ``[s, b, h]``; ``layer_number`` is global and 1-based."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaLayerSubmodules | None = None,
        layer_number: int = 1,
        pg_collection=None,
    ):
        super().__init__()
        submodules = submodules or MambaLayerSubmodules()
        self.config = config
        self.layer_number = layer_number
        self.norm = build_module(submodules.norm, config, config.hidden_size)
        self.mixer = build_module(submodules.mixer, config, layer_number=layer_number, pg_collection=pg_collection)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        """Masks and rotary embeddings belong to attention layers; a Mamba layer ignores them."""
        out, bias = self.mixer(self.norm(hidden_states), inference_context=inference_context)
        if bias is not None:
            out = out + bias
        out = dropout(out, self.config.hidden_dropout, self.training, sharded_over_tp=self.config.sequence_parallel)
        return hidden_states + out
