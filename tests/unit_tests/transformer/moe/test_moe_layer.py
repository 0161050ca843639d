"""MoE layer on one rank against a per-token loop reference: dropless and with token dropping,
gated and plain experts with biases, shared experts, gradients, and batch invariance in the
engine's mode."""

import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.inference.kernels import batch_invariant
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe.token_dispatcher import permute, unpermute
from tests.unit_tests.transformer.moe.reference import moe_reference
from tests.unit_tests.transformer.single_rank import on_single_rank


def _config(**overrides):
    settings = dict(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        ffn_hidden_size=12,
        num_moe_experts=4,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def test_permute_sorts_slots_by_expert_and_unpermute_inverts_it():
    hidden = torch.arange(3.0).view(3, 1)  # token t holds the value t
    expert_of_slot = torch.tensor([[2, 0], [0, 3], [1, 3]])  # 3: a skipped slot (3 experts)
    permuted, order, tokens_per_expert = permute(hidden, expert_of_slot, 3)
    assert tokens_per_expert.tolist() == [2, 1, 1]
    assert permuted.view(-1).tolist() == [0.0, 1.0, 2.0, 0.0]  # expert 0: tokens 0, 1; 1: 2; 2: 0
    probs = torch.tensor([[0.5, 0.25], [1.0, 7.0], [2.0, 7.0]])
    out = unpermute(permuted * 10, order, probs)
    assert out.view(-1).tolist() == [0.0 * 0.5 + 0.0 * 0.25, 1.0 * 10, 2.0 * 2 * 10]


@on_single_rank
def test_dropless_gated_moe_equals_the_per_token_reference_with_gradients(pg):
    torch.manual_seed(0)
    layer = MoELayer(_config(), pg_collection=pg)
    x = torch.randn(5, 3, 8, requires_grad=True)
    out, bias = layer(x)
    assert bias is None
    x_ref = x.detach().clone().requires_grad_(True)
    ref = moe_reference(layer, x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [x.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    ref.backward(grad)
    expected = [x_ref.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@on_single_rank
def test_capacity_dropping_and_shared_experts_with_biases(pg):
    torch.manual_seed(1)
    config = _config(
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
        moe_expert_capacity_factor=0.5,
        moe_shared_expert_intermediate_size=6,
    )
    layer = MoELayer(config, pg_collection=pg)
    for p in layer.experts.parameters():
        torch.nn.init.normal_(p)  # biases are zeros at init
    x = torch.randn(4, 2, 8)
    out, _ = layer(x)
    _, expert_of_slot = layer.router(x.view(-1, 8))
    assert (expert_of_slot == 4).any()  # some slots were dropped
    assert torch.bincount(expert_of_slot.view(-1), minlength=5)[:4].max() <= 2  # ceil(8 * 2 / 4 * 0.5)
    shared, shared_bias = layer.shared_experts(x)
    torch.testing.assert_close(out, moe_reference(layer, x) + shared + shared_bias, rtol=1e-5, atol=1e-6)


@on_single_rank
def test_routed_output_of_a_row_does_not_depend_on_the_batch_in_batch_invariant_mode(pg):
    torch.manual_seed(2)
    layer = MoELayer(_config(moe_shared_expert_intermediate_size=6), pg_collection=pg).eval()
    x = torch.randn(7, 5, 8)
    with torch.no_grad(), batch_invariant(True):
        together, _ = layer(x)
        for b in range(5):
            alone, _ = layer(x[:, b : b + 1])
            assert torch.equal(alone[:, 0], together[:, b])
