"""Top-k router: expert choice and weights of each score function, the auxiliary losses against
hand-computed formulas, their gradient through the autograd scaler, capacity dropping, and
Sinkhorn balancing (its scaling's sums, and the choice it makes in training only)."""

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter, sinkhorn_balance


def _config(**moe):
    moe.setdefault("num_moe_experts", 4)
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **moe)


def _router_and_tokens(**moe):
    torch.manual_seed(0)
    router = TopKRouter(_config(**moe))
    return router, torch.randn(6, 8)


def test_softmax_router_softmaxes_the_topk_logits():
    router, x = _router_and_tokens(moe_router_topk=2)
    probs, experts = router(x)
    logits = x @ router.weight.t()
    top = logits.topk(2, dim=-1)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(probs, torch.softmax(top.values, dim=-1))


def test_pre_softmax_router_keeps_the_unnormalized_probabilities():
    router, x = _router_and_tokens(moe_router_topk=2, moe_router_pre_softmax=True)
    probs, experts = router(x)
    full = torch.softmax(x @ router.weight.t(), dim=-1)
    top = full.topk(2, dim=-1)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(probs, top.values)


def test_sigmoid_router_with_expert_bias_shifts_the_choice_not_the_weights():
    router, x = _router_and_tokens(
        moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 10.0]))  # experts 0 and 3 always win
    probs, experts = router(x)
    assert torch.equal(experts.sort(-1).values, torch.tensor([[0, 3]] * 6))
    scores = torch.sigmoid(x @ router.weight.t()).gather(-1, experts)
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))


def test_expert_bias_update_moves_toward_the_underloaded_experts():
    router, x = _router_and_tokens(moe_router_topk=1, moe_router_enable_expert_bias=True)
    router.train()
    router.local_tokens_per_expert.copy_(torch.tensor([6.0, 0.0, 1.0, 1.0]))
    router.update_expert_bias()
    rate = router.config.moe_router_bias_update_rate
    torch.testing.assert_close(router.expert_bias, torch.tensor([-rate, rate, rate, rate]))
    assert not router.local_tokens_per_expert.any()


def test_load_balancing_and_z_losses_match_their_formulas_and_reach_the_router_gradient():
    router, x = _router_and_tokens(moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    router.train()
    probs, experts = router(x)
    logits = x @ router.weight.t()
    scores = torch.softmax(logits, dim=-1)
    # Switch-style: E * coeff * sum_e (fraction of slots to e) * (mean score of e)
    fraction = torch.stack([(experts == e).sum() for e in range(4)]).float() / (6 * 2)
    expected_aux = 4 * 0.1 * (fraction * scores.mean(0)).sum()
    expected_z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(router.aux_losses["load_balancing_loss"], expected_aux)
    torch.testing.assert_close(router.aux_losses["z_loss"], expected_z)

    weights = torch.randn(6, 2)
    (probs * weights).sum().backward()
    got = router.weight.grad.clone()
    reference = router.weight.detach().clone().requires_grad_(True)
    ref_logits = x @ reference.t()
    ref_probs = torch.softmax(ref_logits.gather(-1, experts), -1)
    ref_scores = torch.softmax(ref_logits, -1)
    total = (
        (ref_probs * weights).sum()
        + 4 * 0.1 * (fraction * ref_scores.mean(0)).sum()
        + 0.01 * torch.logsumexp(ref_logits, -1).square().mean()
    )
    total.backward()
    torch.testing.assert_close(got, reference.grad)


def test_sequence_aux_loss_averages_the_loss_of_each_sequence():
    router, x = _router_and_tokens(
        moe_router_topk=1, moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="seq_aux_loss"
    )
    router.train()
    _, experts = router(x, seq_length=3)  # tokens [s=3, b=2] flattened s-major
    scores = torch.softmax(x @ router.weight.t(), -1).view(3, 2, 4)
    per_sequence = []
    for b in range(2):
        fraction = torch.stack([(experts.view(3, 2)[:, b] == e).sum() for e in range(4)]).float() / 3
        per_sequence.append(4 * (fraction * scores[:, b].mean(0)).sum())
    torch.testing.assert_close(router.aux_losses["load_balancing_loss"], torch.stack(per_sequence).mean())


def test_capacity_factor_keeps_each_experts_most_probable_tokens():
    # pre-softmax: top-1 weights differ between tokens (softmax over one logit would be 1 for all)
    router, x = _router_and_tokens(moe_router_topk=1, moe_expert_capacity_factor=0.5, moe_router_pre_softmax=True)
    router.weight.data.zero_()
    router.weight.data[0, 0] = 1.0  # every token prefers expert 0, by x[:, 0]
    x[:, 0] = torch.arange(6.0) + 1.0
    probs, experts = router(x)
    capacity = 1  # ceil(6 tokens * 1 / 4 experts * 0.5)
    kept = experts[:, 0] == 0
    assert kept.sum() == capacity and kept[5]  # the most probable token
    assert torch.equal(experts[~kept, 0], torch.full((5,), 4))  # dropped slots point past the experts
    assert not probs[~kept].any()


def test_bad_moe_settings_name_the_field():
    with pytest.raises(ConfigError, match="moe_router_topk must be in \\[1, num_moe_experts \\(4\\)\\], got 5"):
        _config(moe_router_topk=5)
    with pytest.raises(ConfigError, match="moe_router_score_function must be 'softmax' or 'sigmoid', got 'relu'"):
        _config(moe_router_score_function="relu")
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type must be 'allgather' or 'alltoall'"):
        _config(moe_token_dispatcher_type="flex")
    with pytest.raises(ConfigError, match="sinkhorn load balancing balances the expert choice itself"):
        _config(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01)


def test_sinkhorn_scaling_gives_equal_expert_columns_and_equal_token_rows():
    torch.manual_seed(0)
    logits = torch.randn(32, 4) * 3
    balanced = sinkhorn_balance(logits)
    torch.testing.assert_close(balanced.sum(0), torch.full((4,), 1 / 4))
    torch.testing.assert_close(balanced.sum(1), torch.full((32,), 1 / 32), rtol=1e-2, atol=1e-5)
    # a shift of every logit changes nothing (but fp32 rounding of the shifted logits), and
    # large logits do not overflow exp()
    shifted = sinkhorn_balance(logits + 1000.0)
    assert shifted.isfinite().all()
    torch.testing.assert_close(shifted, balanced, rtol=1e-3, atol=1e-7)


def test_sinkhorn_router_balances_its_choice_in_training_only():
    router, x = _router_and_tokens(moe_router_topk=2, moe_router_load_balancing_type="sinkhorn")
    common = torch.ones(8) / 8**0.5
    x = torch.randn(64, 8) * 0.5 + 2 * common
    with torch.no_grad():
        router.weight[0] = 3 * common  # expert 0 is every token's favourite
    logits = x @ router.weight.t()
    weights = torch.softmax(logits, dim=-1)
    router.train()
    probs, experts = router(x)
    assert torch.equal(experts, sinkhorn_balance(logits).topk(2, dim=-1).indices)
    torch.testing.assert_close(probs, weights.gather(-1, experts))
    balanced_load = torch.bincount(experts.flatten(), minlength=4)
    router.eval()
    probs, experts = router(x)
    assert torch.equal(experts, weights.topk(2, dim=-1).indices)
    torch.testing.assert_close(probs, weights.gather(-1, experts))
    greedy_load = torch.bincount(experts.flatten(), minlength=4)
    assert greedy_load[0] == 64 and balanced_load.max() < 64 and balanced_load.min() > 0


def test_sinkhorn_top1_router_weighs_by_the_sigmoid():
    router, x = _router_and_tokens(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn")
    router.train()
    probs, experts = router(x)
    torch.testing.assert_close(probs, torch.sigmoid(x @ router.weight.t()).gather(-1, experts))
