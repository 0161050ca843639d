"""Shared tiny configurations and helpers of the hybrid model tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.config import TransformerConfig
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.process_groups import ProcessGroupCollection, RankLayout

VOCAB, SEQ = 100, 8


def hybrid_config(**overrides) -> TransformerConfig:
    """A tiny hybrid config: 4 attention heads (2 KV groups), 8 Mamba heads in 2 groups."""
    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        add_bias_linear=False,
        mamba_num_heads=8,
        mamba_head_dim=8,
        mamba_num_groups=2,
        mamba_state_dim=8,
        mamba_d_conv=4,
        mamba_chunk_size=4,
    )
    return TransformerConfig(**(base | overrides))


def collection(tp: int = 1, gtp: int = 1, pp: int = 1) -> ProcessGroupCollection:
    """The world's collection for a layout (dp fills the rest)."""
    return ProcessGroupCollection.from_layout(RankLayout.for_world(dist.get_world_size(), tp=tp, gtp=gtp, pp=pp))


def build_model(config, pattern, pg, **kwargs) -> HybridModel:
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    return HybridModel(
        config,
        get_hybrid_stack_local_spec(),
        VOCAB,
        SEQ,
        hybrid_layer_pattern=pattern,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        pg_collection=pg,
        **kwargs,
    )


def batch(seed: int, size: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(0, VOCAB, (size, SEQ), generator=g)
