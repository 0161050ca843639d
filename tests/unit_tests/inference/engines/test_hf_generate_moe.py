"""Greedy generations of the engine (MoE layers, batch-invariant routing) equal HuggingFace
``generate`` for Mixtral and a NemotronH with ``moe`` layers, random weights mapped to ours."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from megatron.core.models import hf_mapping
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from tests.unit_tests.inference.engines.common import prompts
from tests.unit_tests.inference.engines.test_hf_generate import PROMPT_LENGTHS, _engine_greedy, _hf_greedy, _perturbed
from tests.unit_tests.models.hybrid.test_hf_nemotron import nemotron_h_moe_model
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_mixtral_greedy_generation_matches_transformers(pg):
    torch.manual_seed(3)
    hf = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # decisive routing
    hf = _perturbed(hf)
    config, kwargs = hf_mapping.mixtral_config_from_hf(hf.config)
    model = GPTModel(config, get_gpt_layer_local_spec(config.num_moe_experts), pg_collection=pg, **kwargs).eval()
    model.load_state_dict(hf_mapping.mixtral_state_dict_from_hf(hf.state_dict(), config), strict=True)
    ours = _engine_greedy(model, pg)
    assert ours == [_hf_greedy(hf, p) for p in prompts(PROMPT_LENGTHS)]


@on_single_rank
def test_nemotron_h_moe_greedy_generation_matches_transformers(pg):
    hf = nemotron_h_moe_model(vocab_size=96)
    config, kwargs = hf_mapping.nemotron_h_config_from_hf(hf.config)
    model = HybridModel(config, get_hybrid_stack_local_spec(), pg_collection=pg, **kwargs).eval()
    model.load_state_dict(
        hf_mapping.nemotron_h_state_dict_from_hf(hf.state_dict(), config, kwargs["hybrid_layer_pattern"]), strict=True
    )
    ours = _engine_greedy(model, pg)
    assert ours == [_hf_greedy(hf, p) for p in prompts(PROMPT_LENGTHS)]
