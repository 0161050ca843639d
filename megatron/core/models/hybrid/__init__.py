"""Hybrid Mamba/attention/MLP language model, its layer patterns and NemotronH interop."""

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_pattern import (
    HybridLayerPattern,
    HybridPatternError,
    parse_hybrid_pattern,
    select_stage_layers,
)
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_mtp_block_spec, get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = [
    "HybridStack",
    "HybridStackSubmodules",
    "HybridLayerPattern",
    "HybridPatternError",
    "parse_hybrid_pattern",
    "select_stage_layers",
    "get_hybrid_mtp_block_spec",
    "get_hybrid_stack_local_spec",
    "HybridModel",
]
