"""The hybrid stack of one pipeline stage (Mamba / attention / MLP layers from a pattern),
and the layers of one multi-token-prediction depth of a hybrid model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.models.hybrid.hybrid_layer_pattern import (
    ATTENTION,
    MAMBA,
    MLP,
    HybridLayerPattern,
    select_stage_layers,
)
from megatron.core.models.hybrid.hybrid_layers import AttentionLayer, MLPLayer
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.tensor_parallel import checkpoint, init_rng_scope
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import ModuleSpec, build_module


@dataclass
class HybridStackSubmodules:
    """Which spec builds each layer kind of a pattern."""

    mamba_layer: Any = field(default_factory=lambda: ModuleSpec(module=MambaLayer))
    attention_layer: Any = field(default_factory=lambda: ModuleSpec(module=AttentionLayer))
    mlp_layer: Any = field(default_factory=lambda: ModuleSpec(module=MLPLayer))


def build_hybrid_layer(submodules: HybridStackSubmodules, symbol: str, config: TransformerConfig,
                       layer_number: int, pg_collection: ProcessGroupCollection) -> nn.Module:
    """The layer for pattern character ``symbol`` (already validated by the pattern parser)."""
    spec = {MAMBA: submodules.mamba_layer, ATTENTION: submodules.attention_layer, MLP: submodules.mlp_layer}[symbol]
    return build_module(spec, config=config, layer_number=layer_number, pg_collection=pg_collection)


class HybridStack(nn.Module):
    """This pipeline stage's layers of the main pattern (chosen by
    :func:`select_stage_layers`; layer ``n`` built inside ``init_rng_scope(config, f"layer{n}")``)
    and, on the last stage, the final norm. A non-first stage reads the tensor given to
    :meth:`set_input_tensor`. ``forward`` matches TransformerBlock's.
    """

    def __init__(self, config: TransformerConfig, submodules: HybridStackSubmodules, layer_pattern: HybridLayerPattern,
                 pre_process: bool = True, post_process: bool = True,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        pg_collection = resolve_pg_collection(pg_collection)
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        stage = select_stage_layers(layer_pattern, pg_collection.size("pp"), pg_collection.rank("pp"))
        self.layer_numbers = [number for number, _ in stage]
        self.layer_symbols = "".join(symbol for _, symbol in stage)
        layers = []
        for number, symbol in stage:
            with init_rng_scope(config, f"layer{number}"):
                layers.append(build_hybrid_layer(submodules, symbol, config, number, pg_collection))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = None
        if post_process:
            with init_rng_scope(config, "final_norm"):
                self.final_layernorm = build_norm(config)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Hidden states [s, b, h] received from the previous pipeline stage."""
        self.input_tensor = input_tensor

    def forward(self, hidden_states: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                rotary_pos_emb: torch.Tensor | None = None, inference_context=None) -> torch.Tensor:
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError("this pipeline stage has no input: call set_input_tensor() with the previous "
                                 "stage's hidden states before forward")
            hidden_states = self.input_tensor
        full_recompute = self.config.recompute_granularity == "full" and self.training and inference_context is None
        for layer in self.layers:
            if full_recompute:
                hidden_states = checkpoint(layer, hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                      inference_context=inference_context)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


class HybridMTPLayers(nn.Module):
    """The inner layers of one MTP depth: depth ``k = layer_number - config.num_layers`` uses
    the k-th ``/`` pattern. Used as the ``transformer_layer`` of the shared MTP block; every
    inner layer gets the depth's ``layer_number``."""

    def __init__(self, config: TransformerConfig, submodules: HybridStackSubmodules, layer_number: int,
                 mtp_patterns: tuple[str, ...], pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        pg_collection = resolve_pg_collection(pg_collection)
        pattern = mtp_patterns[layer_number - config.num_layers - 1]
        self.layer_symbols = pattern
        self.layers = nn.ModuleList(
            build_hybrid_layer(submodules, symbol, config, layer_number, pg_collection) for symbol in pattern
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, rotary_pos_emb=None) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return hidden_states
