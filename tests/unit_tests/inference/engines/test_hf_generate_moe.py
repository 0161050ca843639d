"""Greedy generations of the engine (MoE layers, batch-invariant routing) equal HuggingFace
``generate`` for Mixtral, Qwen3-MoE and a NemotronH with ``moe`` layers, random weights mapped to
ours."""

from megatron.core.models import hf_mapping
from tests.unit_tests.inference.engines.test_hf_generate import (
    _perturbed,
    assert_engine_matches_hf_greedy,
    assert_hybrid_engine_matches_hf_greedy,
)
from tests.unit_tests.models.gpt.hf_moe_models import mixtral_model, qwen3_moe_model
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


@on_single_rank
def test_nemotron_h_moe_greedy_generation_matches_transformers(pg):
    assert_hybrid_engine_matches_hf_greedy(nemotron_h_moe_model(vocab_size=96), pg)
