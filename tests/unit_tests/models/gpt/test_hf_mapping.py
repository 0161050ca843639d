"""Our GPTModel equals HuggingFace Llama / Mixtral / Qwen3-MoE / DeepSeek-V3 / GPT-2 (random
weights) after mapping, and the mapping round-trips bit-identically in both directions."""

import dataclasses

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    Qwen3MoeConfig,
)

from megatron.core.models import hf_mapping
from megatron.core.models.gpt import GPTModel, get_gpt_decoder_layer_specs
from megatron.core.models.model_record import ModelRecord
from tests.unit_tests.models.gpt.hf_moe_models import deepseek_v3_model, mixtral_model, qwen3_moe_model
from tests.unit_tests.transformer.single_rank import on_single_rank

VOCAB, SEQ, BATCH = 100, 12, 2


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Perturb every parameter (norm weights too) so no mapping mistake hides behind init values."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _llama(tied: bool, rope_scaling: dict | None):
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_scaling=rope_scaling,
        rope_theta=500000.0 if rope_scaling else 10000.0,
    )
    return (
        _randomized(LlamaForCausalLM(config)),
        hf_mapping.llama_config_from_hf,
        hf_mapping.llama_state_dict_from_hf,
        hf_mapping.llama_state_dict_to_hf,
    )


def _mixtral():
    return (
        _randomized(mixtral_model(VOCAB, seed=4)),
        hf_mapping.mixtral_config_from_hf,
        hf_mapping.mixtral_state_dict_from_hf,
        hf_mapping.mixtral_state_dict_to_hf,
    )


def _qwen3_moe(norm_topk_prob: bool):
    return (
        _randomized(qwen3_moe_model(VOCAB, seed=5, norm_topk_prob=norm_topk_prob)),
        hf_mapping.qwen3_moe_config_from_hf,
        hf_mapping.qwen3_moe_state_dict_from_hf,
        hf_mapping.qwen3_moe_state_dict_to_hf,
    )


def _deepseek_v3(q_lora_rank: int | None, rope_parameters: dict | None = None, dense_layers: int = 1):
    model = deepseek_v3_model(VOCAB, 6, q_lora_rank, rope_parameters, first_k_dense_replace=dense_layers)
    return (
        _randomized(model),
        hf_mapping.deepseek_v3_config_from_hf,
        hf_mapping.deepseek_v3_state_dict_from_hf,
        hf_mapping.deepseek_v3_state_dict_to_hf,
    )


def _gpt2():
    torch.manual_seed(2)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
    )
    return (
        _randomized(GPT2LMHeadModel(config)),
        hf_mapping.gpt2_config_from_hf,
        hf_mapping.gpt2_state_dict_from_hf,
        hf_mapping.gpt2_state_dict_to_hf,
    )


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# YaRN: the attention factor HF infers from the factor alone, and DeepSeek's mscale pair with
# its own betas and unrounded correction range
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN_MSCALE = {**YARN_SCALING, "mscale": 1.2, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2, "truncate": False}
CASES = {
    "llama": lambda: _llama(tied=False, rope_scaling=None),
    "llama_yarn_rope": lambda: _llama(tied=False, rope_scaling=YARN_SCALING),
    "llama_yarn_rope_mscale": lambda: _llama(tied=False, rope_scaling=YARN_MSCALE),
    "llama_tied_llama3_rope": lambda: _llama(tied=True, rope_scaling=LLAMA3_SCALING),
    "mixtral": _mixtral,
    "qwen3_moe": lambda: _qwen3_moe(norm_topk_prob=True),
    "qwen3_moe_unnormalized_topk": lambda: _qwen3_moe(norm_topk_prob=False),
    "deepseek_v3": lambda: _deepseek_v3(q_lora_rank=24),
    "deepseek_v3_dense_direct_queries": lambda: _deepseek_v3(q_lora_rank=None, dense_layers=3),
    "deepseek_v3_direct_queries_yarn": lambda: _deepseek_v3(q_lora_rank=None, rope_parameters=YARN_MSCALE),
    "deepseek_v3_yarn_attention_factor": lambda: _deepseek_v3(
        q_lora_rank=24, rope_parameters={**YARN_SCALING, "attention_factor": 1.3, "mscale_all_dim": 0.8}
    ),
    "gpt2": _gpt2,
}


@pytest.mark.parametrize("case", list(CASES))
@on_single_rank
def test_logits_match_huggingface_and_mapping_round_trips(pg, case):
    hf_model, config_from_hf, from_hf, to_hf = CASES[case]()
    config, kwargs = config_from_hf(hf_model.config)
    tied = kwargs["share_embeddings_and_output_weights"]
    spec = get_gpt_decoder_layer_specs(config)
    model = GPTModel(config, spec, parallel_output=False, pg_collection=pg, **kwargs).eval()

    hf_state = hf_model.state_dict()
    model.load_state_dict(from_hf(hf_state, config, tied=tied), strict=True)

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf_model(ids).logits
    assert ours.shape == theirs.shape == (BATCH, SEQ, VOCAB)
    assert (ours - theirs).abs().max().item() <= 1e-4

    back = to_hf(from_hf(hf_state, config, tied=tied), config, VOCAB)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    ours_state = model.state_dict()
    again = from_hf(to_hf(ours_state, config, VOCAB), config, tied=tied)
    assert again.keys() == ours_state.keys()
    assert all(torch.equal(again[k], ours_state[k]) for k in ours_state)


@pytest.mark.parametrize(
    "hf_config, config_from_hf, config_to_hf",
    [
        (MixtralConfig, hf_mapping.mixtral_config_from_hf, hf_mapping.mixtral_config_to_hf),
        (Qwen3MoeConfig, hf_mapping.qwen3_moe_config_from_hf, hf_mapping.qwen3_moe_config_to_hf),
    ],
    ids=["mixtral", "qwen3_moe"],
)
def test_moe_config_export_round_trips(hf_config, config_from_hf, config_to_hf):
    """A model trained here exports as the HF config that imports back to the same model."""
    config, kwargs = config_from_hf(
        hf_config(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=64,
            head_dim=16,
        )
    )
    record = ModelRecord(family="gpt", config=config, **kwargs)
    again, again_kwargs = config_from_hf(hf_config(**config_to_hf(record)))
    assert (again, again_kwargs) == (config, kwargs)
    interleaved = record.replace(config=dataclasses.replace(config, rotary_interleaved=True))
    with pytest.raises(hf_mapping.HFMappingError, match=r"interleaved RoPE \(Llama rotates the two halves"):
        config_to_hf(interleaved)


def test_moe_models_refuse_the_other_architecture():
    mixtral, kwargs = hf_mapping.mixtral_config_from_hf(
        MixtralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    )
    with pytest.raises(hf_mapping.HFMappingError, match="no per-head query/key norms"):
        hf_mapping.qwen3_moe_config_to_hf(ModelRecord(family="gpt", config=mixtral, **kwargs))
    with pytest.raises(hf_mapping.HFMappingError, match="MoE layers"):
        hf_mapping.llama_config_to_hf(ModelRecord(family="gpt", config=mixtral, **kwargs))


def test_gpt2_uses_tanh_gelu_and_ties_embeddings():
    config, kwargs = hf_mapping.gpt2_config_from_hf(GPT2Config(n_embd=32, n_layer=1, n_head=2))
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(config.activation_func(x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert kwargs["share_embeddings_and_output_weights"] is True
    assert kwargs["position_embedding_type"] == "learned_absolute"


def test_unsupported_hf_settings_are_rejected_with_the_setting_named():
    with pytest.raises(hf_mapping.HFMappingError, match="scale_attn_by_inverse_layer_idx"):
        hf_mapping.gpt2_config_from_hf(GPT2Config(n_embd=32, n_layer=1, n_head=2, scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(hf_mapping.HFMappingError, match="hidden_act must be 'silu'"):
        hf_mapping.llama_config_from_hf(LlamaConfig(hidden_size=32, num_attention_heads=2, hidden_act="gelu"))
    with pytest.raises(hf_mapping.HFMappingError, match="rope_type 'dynamic' is not supported"):
        hf_mapping.llama_config_from_hf(
            LlamaConfig(
                hidden_size=32,
                num_attention_heads=2,
                rope_scaling={"rope_type": "dynamic", "factor": 2.0},
            )
        )


def test_hf_state_dict_with_unknown_keys_is_rejected():
    hf_model, config_from_hf, from_hf, _ = _gpt2()
    config, _ = config_from_hf(hf_model.config)
    state = dict(hf_model.state_dict(), **{"transformer.extra.weight": torch.zeros(1)})
    with pytest.raises(hf_mapping.HFMappingError, match="does not know"):
        from_hf(state, config)


@pytest.mark.parametrize("scaling", [YARN_SCALING, YARN_MSCALE], ids=["inferred", "mscale"])
def test_yarn_config_exports_as_the_same_rope(scaling):
    """Exported with an explicit attention factor, a YaRN model imports back to the same
    frequencies and logit scale."""
    from megatron.core.transformer.rope import RotaryEmbedding, yarn_concentration

    hf_model, *_ = _llama(tied=False, rope_scaling=scaling)
    config, kwargs = hf_mapping.llama_config_from_hf(hf_model.config)
    record = ModelRecord(family="gpt", config=config, **kwargs)
    again, again_kwargs = hf_mapping.llama_config_from_hf(LlamaConfig(**hf_mapping.llama_config_to_hf(record)))
    assert again_kwargs["position_embedding_type"] == "yarn"
    assert yarn_concentration(again) == pytest.approx(yarn_concentration(config), rel=1e-12)
    frequencies = [RotaryEmbedding(c.kv_channels, yarn_config=c).inv_freq for c in (config, again)]
    torch.testing.assert_close(frequencies[0], frequencies[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    "rope", [None, YARN_MSCALE, {**YARN_SCALING, "mscale": 1.2}], ids=["plain", "mscale-pair", "attention-factor"]
)
def test_deepseek_v3_config_export_round_trips(rope):
    """A DeepSeek-style model trained here exports as the HF config that imports back to the
    same model (YaRN without an mscale pair goes out as HF's explicit attention factor)."""
    config, kwargs = hf_mapping.deepseek_v3_config_from_hf(
        deepseek_v3_model(VOCAB, seed=0, rope_parameters=rope).config
    )
    record = ModelRecord(family="gpt", config=config, **kwargs)
    again = hf_mapping.deepseek_v3_config_from_hf(DeepseekV3Config(**hf_mapping.deepseek_v3_config_to_hf(record)))
    assert again == (config, kwargs)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"moe_router_score_function": "softmax"}, "softmax router scores"),
        ({"moe_router_enable_expert_bias": False}, r"no expert bias \(needs --moe-router-enable-expert-bias\)"),
        ({"moe_layer_freq": [1, 0, 1]}, r"MoE layers not all after the dense ones \(moe_layer_freq \[1, 0, 1\]\)"),
        ({"moe_shared_expert_intermediate_size": 40}, "shared experts 40 wide"),
        ({"multi_latent_attention": False}, "no multi-latent attention"),
    ],
)
def test_deepseek_v3_export_refuses_what_the_architecture_cannot_say(change, message):
    config, kwargs = hf_mapping.deepseek_v3_config_from_hf(deepseek_v3_model(VOCAB, seed=0).config)
    record = ModelRecord(family="gpt", config=dataclasses.replace(config, **change), **kwargs)
    with pytest.raises(hf_mapping.HFMappingError, match=message):
        hf_mapping.deepseek_v3_config_to_hf(record)


def test_deepseek_v3_settings_we_cannot_represent_are_refused():
    bad = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    with pytest.raises(hf_mapping.HFMappingError, match=r"attention biases.*; num_key_value_heads 2 other than"):
        hf_mapping.deepseek_v3_config_from_hf(bad)
