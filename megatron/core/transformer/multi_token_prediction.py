"""Multi-token prediction (DeepSeek-V3 style), shared by GPT and hybrid models.

Depth k (1..D) predicts token t+k+1 at position t. It normalizes the embedding of the
input tokens shifted left by k and the previous depth's hidden state (the main model's final
hidden for k = 1), concatenates them [emb; hidden], projects 2h -> h (column-parallel,
gathered), runs one inner layer (any layer spec whose forward takes ``(hidden,
attention_mask=, rotary_pos_emb=)``) and a final norm. Its output feeds both the shared output
head and depth k+1. The depth-k loss uses the labels shifted left by k; the last k positions
have no target and contribute nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    init_rng_scope,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.context_parallel.sharding import cp_size_of, on_whole_sequence
from megatron.core.transformer.init_methods import init_method
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import ModuleSpec, build_module


@dataclass
class MultiTokenPredictionLayerSubmodules:
    """Parts of one MTP depth; ``transformer_layer`` (the inner layer spec) is required."""

    transformer_layer: Any
    enorm: Any = build_norm
    hnorm: Any = build_norm
    eh_proj: Any = ColumnParallelLinear
    layer_norm: Any = build_norm


def get_mtp_block_spec(transformer_layer_spec: Any) -> ModuleSpec:
    """Spec of an MTP block whose depths each use ``transformer_layer_spec`` as inner layer."""
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionLayerSubmodules(transformer_layer=transformer_layer_spec),
    )


def roll_left(tokens: torch.Tensor, shift: int, fill: int = 0, cp_group=None) -> torch.Tensor:
    """``out[:, t] = tokens[:, t + shift]``; the last ``shift`` positions get ``fill``. Under
    context parallelism (``cp_group``) ``tokens`` is this rank's part of the sequence and
    ``t`` a global position (see :func:`~megatron.core.transformer.context_parallel.sharding.on_whole_sequence`)."""

    def roll(whole):
        out = torch.full_like(whole, fill)
        if shift < whole.shape[1]:
            out[:, : whole.shape[1] - shift] = whole[:, shift:]
        return out

    return on_whole_sequence(roll, tokens, cp_group)


def shifted_target_mask(labels: torch.Tensor, shift: int, cp_group=None) -> torch.Tensor:
    """[b, s] float mask: 1 where position t has a depth-``shift`` target (t + shift < s); under
    context parallelism this rank's part of it."""

    def mask_of(whole):
        mask = torch.ones(whole.shape, dtype=torch.float32, device=whole.device)
        mask[:, max(whole.shape[1] - shift, 0) :] = 0.0
        return mask

    return on_whole_sequence(mask_of, labels, cp_group)


def combine_mtp_losses(
    main_loss: torch.Tensor, depth_losses: list[torch.Tensor], scaling_factor: float
) -> torch.Tensor:
    """Per-token ``main + scaling_factor * mean_k(depth_loss_k)`` ([b, s]); each depth loss is
    already zero where it has no target."""
    if not depth_losses:
        return main_loss
    return main_loss + scaling_factor * torch.stack(depth_losses).mean(dim=0)


class MultiTokenPredictionLayer(nn.Module):
    """One MTP depth: ``forward(embedded [s, b, h], hidden [s, b, h], attention_mask=None,
    rotary_pos_emb=None) -> hidden [s, b, h]`` (sequence-sharded under sequence parallelism)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MultiTokenPredictionLayerSubmodules,
        depth: int,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.config = config
        self.depth = depth
        h = config.hidden_size
        self.enorm = build_module(submodules.enorm, config, h)
        self.hnorm = build_module(submodules.hnorm, config, h)
        self.eh_proj = build_module(
            submodules.eh_proj,
            2 * h,
            h,
            config=config,
            init_method=init_method(config),
            bias=False,
            gather_output=False,
            pg_collection=self.pg_collection,
        )
        self.transformer_layer = build_module(
            submodules.transformer_layer,
            config=config,
            layer_number=config.num_layers + depth,
            pg_collection=self.pg_collection,
        )
        self.final_layernorm = build_module(submodules.layer_norm, config, h)

    def forward(
        self,
        embedded: torch.Tensor,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
    ):
        combined = torch.cat((self.enorm(embedded), self.hnorm(hidden_states)), dim=-1)
        projected, _ = self.eh_proj(combined)
        projected = gather_from_tensor_model_parallel_region(projected, self.pg_collection.tp)
        if self.config.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected, self.pg_collection.tp)
        out = self.transformer_layer(projected, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return self.final_layernorm(out)


class MultiTokenPredictionBlock(nn.Module):
    """``config.mtp_num_layers`` depths, depth k built in ``init_rng_scope(config, f"mtp{k}")``.
    Lives on the last pipeline stage."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MultiTokenPredictionLayerSubmodules,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        if not config.mtp_num_layers:
            raise ConfigError(f"an MTP block needs config.mtp_num_layers >= 1, got {config.mtp_num_layers!r}")
        layers = []
        for depth in range(1, config.mtp_num_layers + 1):
            with init_rng_scope(config, f"mtp{depth}"):
                layers.append(MultiTokenPredictionLayer(config, submodules, depth, pg_collection))
        self.layers = nn.ModuleList(layers)
        pg = resolve_pg_collection(pg_collection)
        self.cp_group = pg.cp if cp_size_of(pg) > 1 else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        hidden_states: torch.Tensor,
        embedding: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Hidden states [s, b, h] of every depth, in order. ``embedding(ids [b, s],
        position_ids)`` is the model's (shared) input embedding; positions are not shifted, so
        slot t of every depth keeps position t."""
        outputs = []
        for depth, layer in enumerate(self.layers, start=1):
            embedded = embedding(roll_left(input_ids, depth, cp_group=self.cp_group), position_ids)
            hidden_states = layer(embedded, hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
            outputs.append(hidden_states)
        return outputs
