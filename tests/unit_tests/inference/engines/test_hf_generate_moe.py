"""Greedy generations of the engine (MoE layers, batch-invariant routing) equal HuggingFace
``generate`` for Mixtral, Qwen3-MoE, DeepSeek-V3 (multi-latent attention, whose keys and values
the paged cache holds at one head size; plain RoPE and YaRN) and a NemotronH with ``moe``
layers, random weights mapped to ours. On a GPU the engine runs their steps eagerly: an MoE
layer sizes each expert's batch from token counts read on the host, which a CUDA graph cannot
replay."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.inference.engines.cuda_graphs import graph_blocker
from megatron.core.models import hf_mapping
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from tests.unit_tests.inference.engines.test_hf_generate import (
    _perturbed,
    assert_engine_matches_hf_greedy,
    assert_hybrid_engine_matches_hf_greedy,
)
from tests.unit_tests.models.gpt.hf_moe_models import deepseek_v3_model, mixtral_model, qwen3_moe_model
from tests.unit_tests.models.gpt.test_hf_mapping import YARN_MSCALE
from tests.unit_tests.models.hybrid.test_hf_nemotron import nemotron_h_moe_model
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_mixtral_greedy_generation_matches_transformers(pg):
    hf = _perturbed(mixtral_model(vocab_size=96, seed=3))
    assert_engine_matches_hf_greedy(hf, hf_mapping.mixtral_config_from_hf, hf_mapping.mixtral_state_dict_from_hf, pg)


@on_single_rank
def test_qwen3_moe_greedy_generation_matches_transformers(pg):
    hf = _perturbed(qwen3_moe_model(vocab_size=96, seed=3))
    assert_engine_matches_hf_greedy(
        hf, hf_mapping.qwen3_moe_config_from_hf, hf_mapping.qwen3_moe_state_dict_from_hf, pg
    )


@pytest.mark.parametrize(
    "q_lora_rank, rope, v_head_dim",
    [(24, None, 8), (None, YARN_MSCALE, 16)],
    ids=["low-rank-queries-narrow-values", "yarn-wide-values"],
)
@on_single_rank
def test_deepseek_v3_greedy_generation_matches_transformers(pg, q_lora_rank, rope, v_head_dim):
    """Values narrower than keys (the cache pads the values) and wider (it pads queries and keys)."""
    hf = _perturbed(
        deepseek_v3_model(vocab_size=96, seed=3, q_lora_rank=q_lora_rank, rope_parameters=rope, v_head_dim=v_head_dim)
    )
    assert_engine_matches_hf_greedy(
        hf, hf_mapping.deepseek_v3_config_from_hf, hf_mapping.deepseek_v3_state_dict_from_hf, pg
    )


@on_single_rank
def test_nemotron_h_moe_greedy_generation_matches_transformers(pg):
    assert_hybrid_engine_matches_hf_greedy(nemotron_h_moe_model(vocab_size=96), pg)


@on_single_rank
def test_moe_models_are_not_captured_in_cuda_graphs(pg):
    """The engine asks graph_blocker whether a stage can be captured: an MoE model's says why not."""
    hf = mixtral_model(vocab_size=96, seed=3)
    config, kwargs = hf_mapping.mixtral_config_from_hf(hf.config)
    model = GPTModel(config, get_gpt_layer_local_spec(config.num_moe_experts), pg_collection=pg, **kwargs)
    on_cuda = SimpleNamespace(device=torch.device("cuda"), pp_size=1, model=model)
    assert graph_blocker(on_cuda, context=None) == (
        "MoE layers size each expert's batch from token counts read on the host, which a graph cannot replay"
    )
