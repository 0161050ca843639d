"""Mixture of experts: router, grouped experts, token dispatchers and the MoE layer."""

from megatron.core.transformer.moe.experts import GroupedMLP, grouped_gemm, grouped_gemm_reference
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler, TopKRouter

__all__ = [
    "GroupedMLP",
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "MoESubmodules",
    "TopKRouter",
    "grouped_gemm",
    "grouped_gemm_reference",
]
