"""Selective recompute of chosen parts (Megatron's ``--recompute-modules``): each part runs again
in backward exactly where it is named (the attention core, dense MLPs, MoE layers, shared
experts, the experts' activation), gradients equal the plain run's, a tiny MoE model trains the
same curve, and the flags' mistakes are refused with one line."""

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.models.gpt import get_gpt_decoder_layer_specs
from megatron.core.transformer.attention import DotProductAttention
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.training.arguments import ArgumentError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny
from tests.unit_tests.transformer.single_rank import on_single_rank


def _config(recompute_modules=None):
    return TransformerConfig(
        num_layers=3,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_layer_freq=[0, 1, 1],  # a dense layer, then two MoE layers
        moe_shared_expert_intermediate_size=8,
        gated_linear_unit=True,
        attention_dropout=0.0,
        recompute_granularity="selective" if recompute_modules is not None else None,
        recompute_modules=recompute_modules,
    )


def _runs_and_grads(pg, recompute_modules):
    """(how often each part ran in one forward and backward, every gradient) of the block."""
    torch.manual_seed(0)
    config = _config(recompute_modules)
    block = TransformerBlock(config, get_gpt_decoder_layer_specs(config), pg_collection=pg)
    parts = {"core_attn": [], "mlp": [], "moe": [], "shared_experts": []}
    for layer in block.layers:
        parts["core_attn"] += [m for m in layer.modules() if isinstance(m, DotProductAttention)]
        moe = isinstance(layer.mlp, MoELayer)
        parts["moe" if moe else "mlp"].append(layer.mlp)
        if moe:
            parts["shared_experts"].append(layer.mlp.shared_experts)
    runs = dict.fromkeys([*parts, "moe_act"], 0)
    for name, modules in parts.items():
        for module in modules:
            module.register_forward_hook(lambda *_, name=name: runs.__setitem__(name, runs[name] + 1))
    activation = experts_module.activation

    def counted_activation(*args):
        runs["moe_act"] += 1
        return activation(*args)

    experts_module.activation = counted_activation
    try:
        x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        block(x).square().sum().backward()
    finally:
        experts_module.activation = activation
    return runs, [x.grad] + [p.grad for p in block.parameters()]


# recompute_modules -> how often each part runs in a forward and backward (1 attention core per
# layer; 1 dense MLP; 2 MoE layers, each with its shared experts and one expert activation).
RUNS = {
    None: {"core_attn": 3, "mlp": 1, "moe": 2, "shared_experts": 2, "moe_act": 2},
    ("core_attn",): {"core_attn": 6, "mlp": 1, "moe": 2, "shared_experts": 2, "moe_act": 2},
    ("mlp",): {"core_attn": 3, "mlp": 2, "moe": 2, "shared_experts": 2, "moe_act": 2},
    ("moe",): {"core_attn": 3, "mlp": 1, "moe": 4, "shared_experts": 4, "moe_act": 4},
    ("shared_experts",): {"core_attn": 3, "mlp": 1, "moe": 2, "shared_experts": 4, "moe_act": 2},
    ("moe_act",): {"core_attn": 3, "mlp": 1, "moe": 2, "shared_experts": 2, "moe_act": 4},
    ("core_attn", "mlp", "shared_experts", "moe_act"): {
        "core_attn": 6,
        "mlp": 2,
        "moe": 2,
        "shared_experts": 4,
        "moe_act": 4,
    },
}


@on_single_rank
def test_each_named_part_is_recomputed_and_the_gradients_do_not_change(pg):
    plain_runs, plain = _runs_and_grads(pg, None)
    assert plain_runs == RUNS[None]
    for modules, expected in RUNS.items():
        if modules is None:
            continue
        runs, grads = _runs_and_grads(pg, list(modules))
        assert runs == expected, modules
        for a, b in zip(plain, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_moe_model_trains_the_same_curve_with_every_part_recomputed(tmp_path):
    moe = ["--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--train-iters", "4"]
    moe += ["--moe-shared-expert-intermediate-size", "16", "--moe-layer-freq", "[0,1]", "--attention-dropout", "0"]
    run = [*CURVE_RUN, "--eval-iters", "0", *moe]
    run_distributed(train_tiny, 1, run, "gpt", 1, tmp_path / "plain.jsonl")
    recompute = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "moe"]
    recompute += ["shared_experts", "moe_act"]
    run_distributed(train_tiny, 1, run + recompute, "gpt", 1, tmp_path / "recompute.jsonl")
    plain = loss_curve(tmp_path / "plain.jsonl")
    assert loss_curve(tmp_path / "recompute.jsonl") == pytest.approx(plain, rel=1e-6)
    assert plain[-1] < plain[0]


def test_the_flags_default_to_megatrons_and_their_mistakes_are_refused():
    base = ["--num-layers", "2", "--train-iters", "1"]
    selective = [*base, "--recompute-granularity", "selective"]
    assert tiny_args(selective).recompute_modules is None
    default = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, recompute_granularity="selective")
    assert default.recomputes("core_attn") and not default.recomputes("mlp")  # Megatron's default: the core alone
    assert tiny_args([*selective, "--recompute-modules", "moe", "mlp"]).recompute_modules == ["moe", "mlp"]
    for flags, message in [
        ([*base, "--recompute-modules", "mlp"], "--recompute-modules needs --recompute-granularity selective"),
        ([*selective, "--recompute-modules", "layernorm"], "--recompute-modules layernorm is not supported"),
        ([*selective, "--recompute-modules", "attn"], "--recompute-modules: unknown attn; supported: core_attn"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            tiny_args(flags)
    with pytest.raises(ConfigError, match="recompute_modules must be None, or some of core_attn, mlp"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, recompute_modules=["mlp"])
