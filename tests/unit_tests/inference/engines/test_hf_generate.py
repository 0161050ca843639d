"""Greedy generations of the engine equal HuggingFace ``generate`` for a Llama-style GPT and a
NemotronH-style hybrid model with random weights converted to ours (hf_mapping)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, NemotronHConfig, NemotronHForCausalLM

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models import hf_mapping
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_layer_specs
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from tests.unit_tests.dist_harness import device
from tests.unit_tests.inference.engines.common import prompts, run
from tests.unit_tests.transformer.single_rank import on_single_rank

NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 11, 3, 8]


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _hf_greedy(hf_model, prompt):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def _engine_greedy(model, pg):
    model.to(device())
    engine = DynamicInferenceEngine(
        model,
        block_size=4,
        num_blocks=64,
        max_requests=8,
        max_tokens_per_step=24,
        max_sequence_length=64,
        enable_chunked_prefill=True,
        pg_collection=pg,
    )
    results = run(engine, prompts(PROMPT_LENGTHS), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    return [results[str(i)]["tokens"] for i in range(len(PROMPT_LENGTHS))]


def assert_engine_matches_hf_greedy(hf, config_from_hf, state_dict_from_hf, pg):
    """Map ``hf`` (a GPT-family HF model) to our GPTModel; the engine's greedy generations of
    the test prompts equal HF ``generate``'s."""
    config, kwargs = config_from_hf(hf.config)
    model = GPTModel(config, get_gpt_decoder_layer_specs(config), pg_collection=pg, **kwargs).eval()
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), config), strict=True)
    assert _engine_greedy(model, pg) == [_hf_greedy(hf, p) for p in prompts(PROMPT_LENGTHS)]


def assert_hybrid_engine_matches_hf_greedy(hf, pg):
    """The same for a NemotronH model mapped to our HybridModel."""
    config, kwargs = hf_mapping.nemotron_h_config_from_hf(hf.config)
    model = HybridModel(config, get_hybrid_stack_local_spec(), pg_collection=pg, **kwargs).eval()
    model.load_state_dict(
        hf_mapping.nemotron_h_state_dict_from_hf(hf.state_dict(), config, kwargs["hybrid_layer_pattern"]), strict=True
    )
    assert _engine_greedy(model, pg) == [_hf_greedy(hf, p) for p in prompts(PROMPT_LENGTHS)]


@on_single_rank
def test_llama_greedy_generation_matches_transformers(pg):
    torch.manual_seed(1)
    hf = _perturbed(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=96,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
        )
    )
    assert_engine_matches_hf_greedy(hf, hf_mapping.llama_config_from_hf, hf_mapping.llama_state_dict_from_hf, pg)


@on_single_rank
def test_nemotron_h_greedy_generation_matches_transformers(pg):
    torch.manual_seed(2)
    hf = NemotronHForCausalLM(
        NemotronHConfig(
            vocab_size=96,
            hidden_size=32,
            hybrid_override_pattern="M*-M-*",
            layers_block_type=None,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            mlp_hidden_act="relu2",
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=8,
            conv_kernel=4,
            chunk_size=4,
            layer_norm_epsilon=1e-5,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            time_step_min=1e-3,
            time_step_max=0.1,
        )
    ).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    assert_hybrid_engine_matches_hf_greedy(hf, pg)
