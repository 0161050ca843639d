"""Transformer building blocks: specs, norms, RoPE, attention, MLP, layers, blocks, MTP."""

from megatron.core.transformer.attention import (
    AttentionInferenceContext,
    DotProductAttention,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.transformer.context_parallel import ContextParallelConfigError
from megatron.core.transformer.mlp import MLP, MLPSubmodules, gelu_tanh
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    get_mtp_block_spec,
)
from megatron.core.transformer.norms import LayerNorm, RMSNorm, build_norm
from megatron.core.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.spec import ModuleSpec, ModuleSpecError, build_module
from megatron.core.transformer.transformer_block import (
    PipelineLayoutError,
    TransformerBlock,
    layer_offset,
    num_layers_per_stage,
    stage_layer_counts,
)
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "AttentionInferenceContext",
    "ContextParallelConfigError",
    "DotProductAttention",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "MLP",
    "MLPSubmodules",
    "gelu_tanh",
    "MultiTokenPredictionBlock",
    "MultiTokenPredictionLayer",
    "MultiTokenPredictionLayerSubmodules",
    "get_mtp_block_spec",
    "LayerNorm",
    "RMSNorm",
    "build_norm",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "ModuleSpec",
    "ModuleSpecError",
    "build_module",
    "PipelineLayoutError",
    "TransformerBlock",
    "layer_offset",
    "num_layers_per_stage",
    "stage_layer_counts",
    "TransformerLayer",
    "TransformerLayerSubmodules",
]
