"""Specs of hybrid stacks built from local torch modules (the mamba-ssm Triton kernels are
picked inside the Mamba mixer by its backend switch, not by the spec)."""

from __future__ import annotations

from megatron.core.models.hybrid.hybrid_block import HybridMTPLayers, HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layers import (
    AttentionLayer,
    AttentionLayerSubmodules,
    MLPLayer,
    MLPLayerSubmodules,
)
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe import MoELayer, MoESubmodules
from megatron.core.transformer.multi_token_prediction import get_mtp_block_spec
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import ModuleSpec


def get_hybrid_stack_local_spec() -> ModuleSpec:
    """Mamba-2 (``M``), causal SDPA attention (``*``), MLP (``-``) and MoE (``E``) layers, each
    pre-norm (LayerNorm/RMSNorm from the config) with a residual add."""
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer, submodules=MambaLayerSubmodules(norm=build_norm, mixer=MambaMixer)
            ),
            attention_layer=ModuleSpec(
                module=AttentionLayer,
                submodules=AttentionLayerSubmodules(
                    norm=build_norm,
                    self_attention=ModuleSpec(
                        module=SelfAttention,
                        params={"attn_mask_type": "causal"},
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=ColumnParallelLinear,
                            core_attention=DotProductAttention,
                            linear_proj=RowParallelLinear,
                        ),
                    ),
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=MLPLayerSubmodules(
                    norm=build_norm,
                    mlp=ModuleSpec(
                        module=MLP,
                        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                    ),
                ),
            ),
            moe_layer=ModuleSpec(
                module=MLPLayer,
                submodules=MLPLayerSubmodules(
                    norm=build_norm, mlp=ModuleSpec(module=MoELayer, submodules=MoESubmodules())
                ),
            ),
        ),
    )


def get_hybrid_mtp_block_spec(hybrid_stack_spec: ModuleSpec, mtp_patterns: tuple[str, ...]) -> ModuleSpec:
    """MTP block whose depth k runs the layers of the k-th ``/`` pattern, built with the
    layer specs of ``hybrid_stack_spec``."""
    inner = ModuleSpec(
        module=HybridMTPLayers, params={"mtp_patterns": tuple(mtp_patterns)}, submodules=hybrid_stack_spec.submodules
    )
    return get_mtp_block_spec(inner)
