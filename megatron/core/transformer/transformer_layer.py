"""Pre-norm transformer layer: x + Attn(Norm(x)), then x + MLP(Norm(x)).

The attention's bias-dropout-add and the MLP's norm run as one fused op
(:meth:`~megatron.core.transformer.norms.RMSNorm.add_and_norm`), the MLP's bias-dropout-add as
another (:func:`megatron.core.fusions.norms.bias_dropout_add`). The input norm also hands out
the residual (:meth:`~megatron.core.transformer.norms.RMSNorm.norm_and_residual`), so the layer
input's two gradients are added inside the norm's backward kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.fusions.norms import bias_dropout_add
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules, call_mlp
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import ModuleSpec, build_module


def mlp_forward(mlp: nn.Module, hidden_states: torch.Tensor):
    """``mlp(hidden_states)`` (a dense MLP or an MoE layer), its activations recomputed in backward
    when selective recompute covers it (``mlp`` / ``moe`` of ``--recompute-modules``)."""
    return call_mlp(mlp, hidden_states, "moe" if isinstance(mlp, MoELayer) else "mlp")


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Any = build_norm
    self_attention: Any = field(
        default_factory=lambda: ModuleSpec(module=SelfAttention, submodules=SelfAttentionSubmodules())
    )
    pre_mlp_layernorm: Any = build_norm
    mlp: Any = field(default_factory=lambda: ModuleSpec(module=MLP, submodules=MLPSubmodules()))


class TransformerLayer(nn.Module):
    """One decoder layer, global 1-based ``layer_number``.

    ``forward(hidden [s, b, h], attention_mask=None, rotary_pos_emb=None,
    inference_context=None) -> hidden [s, b, h]`` (``s`` is the local sequence slice under
    sequence parallelism).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        pg_collection = resolve_pg_collection(pg_collection)
        self.config = config
        self.layer_number = layer_number
        self.input_layernorm = build_module(submodules.input_layernorm, config, config.hidden_size)
        self.self_attention = build_module(
            submodules.self_attention, config=config, layer_number=layer_number, pg_collection=pg_collection
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config, config.hidden_size)
        self.mlp = build_module(submodules.mlp, config=config, pg_collection=pg_collection)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        inference_context=None,
    ) -> torch.Tensor:
        residual, normed = self.input_layernorm.norm_and_residual(hidden_states)
        attn_out, attn_bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            inference_context=inference_context,
        )
        hidden_states, normed = self.pre_mlp_layernorm.add_and_norm(attn_out, attn_bias, residual, self.config)
        mlp_out, mlp_bias = mlp_forward(self.mlp, normed)
        config = self.config
        return bias_dropout_add(
            mlp_out, mlp_bias, hidden_states, config.hidden_dropout, self.training, config.sequence_parallel
        )
