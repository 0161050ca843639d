"""MoE in whole models: ``--num-experts`` turns every GPT MLP into an MoE layer, ``E`` in a hybrid
pattern builds one, the model record carries the MoE settings through a save/load round trip, and
the load-balancing loss reaches the router through the model's backward."""

import pytest
import torch

from megatron.core.models.hybrid.hybrid_layer_pattern import HybridPatternError
from megatron.core.models.model_record import ModelRecord, model_from_record
from megatron.core.transformer.moe import MoELayer
from megatron.training.arguments import ArgumentError, model_record_from_args, parse_args
from tests.unit_tests.training.test_arguments import BASE
from tests.unit_tests.transformer.single_rank import on_single_rank

MOE_FLAGS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "24",
    "--moe-aux-loss-coeff",
    "0.5",
    "--moe-shared-expert-intermediate-size",
    "16",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]


def test_moe_flags_have_megatrons_defaults_and_reach_the_config():
    defaults = parse_args(BASE, world_size=1)
    assert (defaults.num_experts, defaults.moe_router_topk, defaults.moe_aux_loss_coeff) == (None, 2, 0.0)
    assert defaults.moe_router_load_balancing_type == "aux_loss" and defaults.moe_token_dispatcher_type == "allgather"
    assert defaults.moe_router_score_function == "softmax" and defaults.moe_expert_capacity_factor is None
    config = model_record_from_args(parse_args(BASE + MOE_FLAGS, world_size=1), vocab_size=64).config
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 24)
    assert config.moe_shared_expert_intermediate_size == 16 and config.moe_token_dispatcher_type == "alltoall"
    with pytest.raises(ArgumentError, match="moe_router_topk must be in \\[1, num_moe_experts \\(4\\)\\], got 5"):
        parse_args(BASE + MOE_FLAGS + ["--moe-router-topk", "5"], world_size=1)


@on_single_rank
def test_num_experts_turns_gpt_mlps_into_moe_and_the_record_round_trips(pg):
    record = model_record_from_args(parse_args(BASE + MOE_FLAGS, world_size=1), vocab_size=64)
    again = ModelRecord.from_dict(record.to_dict())
    assert again.config.to_dict() == record.config.to_dict()
    model = model_from_record(again, pg_collection=pg)
    moe = [layer.mlp for layer in model.decoder.layers]
    assert len(moe) == 4 and all(isinstance(m, MoELayer) for m in moe)
    assert moe[0].experts.weight1.shape == (4, 32, 24) and moe[0].shared_experts is not None

    model.train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids)
    aux = sum(m.router.aux_losses["load_balancing_loss"] for m in moe)
    assert loss.shape == (2, 16) and aux > 0
    loss.mean().backward()
    with_aux = moe[0].router.weight.grad.clone()
    # The same step without the aux loss gives another router gradient: the loss reached it.
    model.zero_grad()
    for m in moe:
        m.config.moe_aux_loss_coeff = 0.0
    model(ids, labels=ids).mean().backward()
    assert not torch.allclose(with_aux, moe[0].router.weight.grad)


@on_single_rank
def test_e_in_a_hybrid_pattern_is_an_moe_layer(pg):
    mamba = ["--mamba-head-dim", "8", "--mamba-num-groups", "2", "--mamba-state-dim", "8", "--mamba-chunk-size", "4"]
    flags = BASE + MOE_FLAGS + mamba + ["--hybrid-layer-pattern", "M*E-", "--position-embedding-type", "none"]
    record = model_record_from_args(parse_args(flags, model_family="hybrid", world_size=1), vocab_size=64)
    model = model_from_record(record, pg_collection=pg)
    kinds = [
        type(layer.mlp).__name__ if hasattr(layer, "mlp") else type(layer).__name__ for layer in model.decoder.layers
    ]
    assert kinds == ["MambaLayer", "AttentionLayer", "MoELayer", "MLP"]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert model(ids).shape[:2] == (2, 16)
    with pytest.raises((ArgumentError, HybridPatternError), match="needs config.num_moe_experts"):
        parse_args(BASE + mamba + ["--hybrid-layer-pattern", "M*E-"], model_family="hybrid", world_size=1)


@on_single_rank
def test_flops_per_token_count_the_experts_a_token_meets(pg):
    """TFLOP/s of an MoE model counts top-k experts per layer (active parameters), not all of
    them; the router (every expert's logit) and the shared experts count whole."""
    from megatron.training.metrics import training_flops_per_token
    from megatron.training.training import count_flops_per_token

    record = model_record_from_args(parse_args(BASE + MOE_FLAGS, world_size=1), vocab_size=64)
    model = model_from_record(record, pg_collection=pg)
    config = record.config
    h, layers, vocab = config.hidden_size, config.num_layers, model.output_layer.weight.shape[0]
    q, kv = config.num_attention_heads * config.kv_channels, config.num_query_groups * config.kv_channels
    attention = h * (q + 2 * kv) + q * h
    experts = 2 * h * 24 * 2  # top-2 of [h, ffn 24] then [ffn, h], GeLU
    per_layer = attention + 4 * h + experts + 2 * h * 16  # router [4, h]; shared experts ffn 16
    expected = training_flops_per_token(layers * per_layer + vocab * h, layers, 16, h)
    assert count_flops_per_token(model, pg, 16, h, torch.device("cpu")) == expected
