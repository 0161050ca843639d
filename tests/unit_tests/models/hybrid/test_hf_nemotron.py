"""HybridModel against HuggingFace NemotronHForCausalLM (random weights) after the NemotronH
mapping of megatron/core/models/hf_mapping.py."""

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from megatron.core.models.hf_mapping import (
    HFMappingError,
    nemotron_h_config_from_hf,
    nemotron_h_state_dict_from_hf,
    nemotron_h_state_dict_to_hf,
    squared_relu,
)
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.models.hybrid.common import collection

PATTERN = "M*-M-*"


def hf_config(**overrides):
    base = dict(
        vocab_size=100,
        hidden_size=32,
        layers_block_type=None,
        hybrid_override_pattern=PATTERN,
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
    return NemotronHConfig(**(base | overrides))


def hf_model():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(hf_config()).eval()
    with torch.no_grad():  # norms start at ones: make every weight non-trivial
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


MOE_PATTERN = "M*EM-E"


def nemotron_h_moe_model(**overrides):
    """A NemotronH with two ``moe`` layers: 4 relu2 experts in 2 groups (top-2 from the best group),
    a shared expert, a nonzero score-correction bias and a routing scale."""
    torch.manual_seed(0)
    config = hf_config(
        hybrid_override_pattern=MOE_PATTERN,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=16,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        **overrides,
    )
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            if "mixer.gate.weight" in name or "mixer.experts." in name:
                p.normal_(0.0, 0.5)  # HF starts routers at zero; decisive routing instead
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def _logits_vs_hf(make_model=hf_model):
    hf = make_model()
    config, kwargs = nemotron_h_config_from_hf(hf.config)
    model = HybridModel(
        config, get_hybrid_stack_local_spec(), **kwargs, parallel_output=False, pg_collection=collection()
    ).eval()
    pattern = kwargs["hybrid_layer_pattern"]
    model.load_state_dict(nemotron_h_state_dict_from_hf(hf.state_dict(), config, pattern), strict=True)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)
    back = nemotron_h_state_dict_to_hf(model.state_dict(), config, kwargs["vocab_size"], pattern)
    same_keys = set(back) == set(hf.state_dict())
    roundtrip = all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    return tuple(got.shape), (got - want).abs().max().item(), want.abs().max().item(), same_keys, roundtrip


@pytest.mark.parametrize("make_model", [hf_model, nemotron_h_moe_model], ids=["dense", "moe"])
def test_hybrid_model_matches_hf_nemotron_h_logits(make_model):
    ((shape, diff, scale, same_keys, roundtrip),) = run_distributed(_logits_vs_hf, 1, make_model)
    assert shape == (2, 12, 100)
    assert scale > 0.1 and diff <= 1e-4
    assert same_keys and roundtrip


def test_moe_config_translation():
    c, _ = nemotron_h_config_from_hf(nemotron_h_moe_model().config)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 24)
    assert c.moe_shared_expert_intermediate_size == 16 and c.moe_router_score_function == "sigmoid"
    assert c.moe_router_enable_expert_bias and (c.moe_router_num_groups, c.moe_router_group_topk) == (2, 1)
    assert c.moe_router_topk_scaling_factor == 2.5


def test_config_translation():
    c, kwargs = nemotron_h_config_from_hf(hf_config(), tensor_model_parallel_size=2)
    assert kwargs == dict(
        vocab_size=100,
        max_sequence_length=64,
        hybrid_layer_pattern=PATTERN,
        position_embedding_type="none",
        share_embeddings_and_output_weights=False,
    )
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (6, 32, 4, 2, 8)
    assert (c.mamba_num_heads, c.mamba_head_dim, c.mamba_num_groups, c.mamba_state_dim) == (8, 8, 2, 8)
    assert c.activation_func is squared_relu and c.normalization == "RMSNorm" and not c.add_bias_linear
    assert c.tensor_model_parallel_size == 2
    assert torch.equal(squared_relu(torch.tensor([-2.0, 3.0])), torch.tensor([0.0, 9.0]))


def test_config_translation_rejects_what_we_cannot_represent():
    with pytest.raises(HFMappingError, match=r"NemotronH settings not supported: biases in linear layers"):
        nemotron_h_config_from_hf(hf_config(attention_bias=True))
    with pytest.raises(HFMappingError, match=r"NemotronH MoE settings not supported: a latent MoE projection"):
        nemotron_h_config_from_hf(hf_config(hybrid_override_pattern="M*E-", moe_latent_size=8))
