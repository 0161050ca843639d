"""Tiny GPT and hybrid models for checkpoint tests, built for any layout, and their logits
through a hand-run pipeline (stage 0 forward -> send hidden states -> ... -> last stage)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.config import TransformerConfig
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel

VOCAB, SEQ, BATCH, HIDDEN = 100, 8, 2, 32
HYBRID_PATTERN = "M*|M-"


def layout(tp=1, pp=1, gtp=1, cp=1):
    """The world's collection for these sizes (DP fills the rest)."""
    return parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        generalized_tensor_parallel_size=gtp,
        context_parallel_size=cp,
    )


def gpt_config(pg, seed=1234, **extra) -> TransformerConfig:
    return TransformerConfig(
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=True,
        tensor_model_parallel_size=pg.size("tp"),
        pipeline_model_parallel_size=pg.size("pp"),
        generalized_tensor_parallel_size=pg.size("gtp"),
        context_parallel_size=pg.size("cp"),
        init_seed=seed,
        **extra,
    )


def gpt_model(pg, seed=1234, tied=True) -> GPTModel:
    """4 layers, GQA, SwiGLU, biases, learned positions, vocabulary 100 (padded for TP)."""
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    return GPTModel(
        gpt_config(pg, seed),
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        pp_rank == 0,
        pp_rank == pp_size - 1,
        parallel_output=False,
        share_embeddings_and_output_weights=tied,
        pg_collection=pg,
    )


def hybrid_config(pg, seed=1234) -> TransformerConfig:
    return TransformerConfig(
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        add_bias_linear=False,
        mamba_head_dim=8,
        mamba_state_dim=8,
        mamba_num_groups=2,
        tensor_model_parallel_size=pg.size("tp"),
        pipeline_model_parallel_size=pg.size("pp"),
        generalized_tensor_parallel_size=pg.size("gtp"),
        context_parallel_size=pg.size("cp"),
        init_seed=seed,
    )


def hybrid_model(pg, seed=1234) -> HybridModel:
    """Pattern ``M*|M-`` (Mamba, attention | Mamba, MLP), untied, vocabulary 100."""
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    return HybridModel(
        hybrid_config(pg, seed),
        get_hybrid_stack_local_spec(),
        VOCAB,
        SEQ,
        hybrid_layer_pattern=HYBRID_PATTERN,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=False,
        pg_collection=pg,
    )


def tokens(seed=0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, pg, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits [b, s, V] on the last pipeline stage, None on the others."""
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    ranks = dist.get_process_group_ranks(pg.pp)
    if pp_rank > 0:
        hidden = torch.empty(SEQ, BATCH, HIDDEN)
        dist.recv(hidden, src=ranks[pp_rank - 1], group=pg.pp)
        model.set_input_tensor(hidden)
    out = model(ids)
    if pp_rank < pp_size - 1:
        dist.send(out.contiguous(), dst=ranks[pp_rank + 1], group=pg.pp)
        return None
    return out
