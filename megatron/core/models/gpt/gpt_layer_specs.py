"""Layer specs for GPT models built from local torch modules."""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.mla import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe import MoELayer, MoESubmodules
from megatron.core.transformer.multi_token_prediction import get_mtp_block_spec
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def get_gpt_layer_local_spec(num_experts: int | None = None, multi_latent_attention: bool = False) -> ModuleSpec:
    """Pre-norm attention + MLP layer from plain torch parts (SDPA attention); the norm
    (LayerNorm/RMSNorm) and activation (GELU/SwiGLU) follow the config. With ``num_experts``
    the MLP is an MoE layer (router, grouped experts, shared experts when the config sizes them);
    with ``multi_latent_attention`` the attention is MLA (:mod:`megatron.core.transformer.mla`)."""
    mlp = (
        ModuleSpec(module=MoELayer, submodules=MoESubmodules())
        if num_experts
        else ModuleSpec(
            module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        )
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=ModuleSpec(
                module=MLASelfAttention,
                params={"attn_mask_type": "causal"},
                submodules=MLASelfAttentionSubmodules(core_attention=DotProductAttention),
            )
            if multi_latent_attention
            else ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": "causal"},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention, linear_proj=RowParallelLinear
                ),
            ),
            pre_mlp_layernorm=build_norm,
            mlp=mlp,
        ),
    )


def get_gpt_decoder_layer_specs(config) -> ModuleSpec | list[ModuleSpec]:
    """The layer spec of every decoder layer: one spec when all layers are alike, else one per
    (global) layer, MoE where ``config.is_moe_layer`` says (``moe_layer_freq``)."""
    layers = range(1, config.num_layers + 1)
    moe, mla = [config.is_moe_layer(number) for number in layers], config.multi_latent_attention
    if all(moe) or not any(moe):
        return get_gpt_layer_local_spec(config.num_moe_experts if any(moe) else None, mla)
    dense, sparse = get_gpt_layer_local_spec(None, mla), get_gpt_layer_local_spec(config.num_moe_experts, mla)
    return [sparse if is_moe else dense for is_moe in moe]


def get_gpt_mtp_block_spec(transformer_layer_spec: ModuleSpec | None = None) -> ModuleSpec:
    """MTP block spec whose depths use ``transformer_layer_spec`` (default: the local GPT layer)."""
    return get_mtp_block_spec(transformer_layer_spec or get_gpt_layer_local_spec())
