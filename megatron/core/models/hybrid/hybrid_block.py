"""The hybrid stack of one pipeline stage (Mamba / attention / MLP / MoE layers from a pattern),
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
    MOE,
    HybridLayerPattern,
    select_stage_layers,
)
from megatron.core.models.hybrid.hybrid_layers import AttentionLayer, MLPLayer, MLPLayerSubmodules
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.spec import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import StageLayerStack, virtual_pipeline_size, virtual_stage_index


@dataclass
class HybridStackSubmodules:
    """Which spec builds each layer kind of a pattern."""

    mamba_layer: Any = field(default_factory=lambda: ModuleSpec(module=MambaLayer))
    attention_layer: Any = field(default_factory=lambda: ModuleSpec(module=AttentionLayer))
    mlp_layer: Any = field(default_factory=lambda: ModuleSpec(module=MLPLayer))
    moe_layer: Any = field(
        default_factory=lambda: ModuleSpec(
            module=MLPLayer, submodules=MLPLayerSubmodules(mlp=ModuleSpec(module=MoELayer))
        )
    )


def build_hybrid_layer(
    submodules: HybridStackSubmodules,
    symbol: str,
    config: TransformerConfig,
    layer_number: int,
    pg_collection: ProcessGroupCollection,
) -> nn.Module:
    """The layer for pattern character ``symbol`` (already validated by the pattern parser)."""
    spec = {
        MAMBA: submodules.mamba_layer,
        ATTENTION: submodules.attention_layer,
        MLP: submodules.mlp_layer,
        MOE: submodules.moe_layer,
    }[symbol]
    return build_module(spec, config=config, layer_number=layer_number, pg_collection=pg_collection)


class HybridStack(StageLayerStack):
    """This (virtual) pipeline stage's layers of the main pattern (chosen by :func:`select_stage_layers`)
    and, on the last stage, the final norm; ``forward`` is TransformerBlock's."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: HybridStackSubmodules,
        layer_pattern: HybridLayerPattern,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
    ):
        pg_collection = resolve_pg_collection(pg_collection)
        pp_size, pp_rank = pg_collection.size("pp"), pg_collection.rank("pp")
        virtual_stage_index(config, pp_rank, pp_size, vp_stage)  # vp_stage agrees with the config
        stage = select_stage_layers(layer_pattern, pp_size, pp_rank, virtual_pipeline_size(config), vp_stage or 0)
        symbols = dict(stage)
        super().__init__(
            config,
            [number for number, _ in stage],
            lambda number: build_hybrid_layer(submodules, symbols[number], config, number, pg_collection),
            pre_process,
            post_process,
        )
        self.layer_symbols = "".join(symbol for _, symbol in stage)


class HybridMTPLayers(nn.Module):
    """The inner layers of one MTP depth: depth ``k = layer_number - config.num_layers`` uses
    the k-th ``/`` pattern. Used as the ``transformer_layer`` of the shared MTP block; every
    inner layer gets the depth's ``layer_number``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: HybridStackSubmodules,
        layer_number: int,
        mtp_patterns: tuple[str, ...],
        pg_collection: ProcessGroupCollection | None = None,
    ):
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
