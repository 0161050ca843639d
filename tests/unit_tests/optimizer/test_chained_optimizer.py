"""ChainedOptimizer: one grad norm, one clip coefficient and one skip decision for all members."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import (
    ChainedOptimizer,
    OptimizerConfig,
    OptimizerConfigError,
    get_megatron_optimizer,
    step_optimizers,
)
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.optimizer.toy_models import ADAM, batch, dp_collection, tiny_mlp, torch_adamw, wrap_ddp

CLIP = 0.05
ADAM_B = {**ADAM, "lr": 0.02, "weight_decay": 0.0}


def head():
    torch.manual_seed(5)
    return torch.nn.Linear(3, 3).to(device())


def loss_of(body, top, x, y):
    return torch.nn.functional.mse_loss(top(body(x)), y)


def _chain_agrees_on_norm_and_skip():
    pgc = dp_collection(2)
    body, top = tiny_mlp(), head()
    ref_body, ref_top = tiny_mlp(), head()
    ref_opts = [torch_adamw(ref_body.parameters(), **ADAM), torch_adamw(ref_top.parameters(), **ADAM_B)]
    ddps = [wrap_ddp(body, pgc), wrap_ddp(top, pgc)]
    scaled = dict(fp16=True, initial_loss_scale=4.0, hysteresis=1, clip_grad=CLIP)
    chain = ChainedOptimizer(
        [
            get_megatron_optimizer(OptimizerConfig(**ADAM, **scaled), ddps[0], pgc),
            get_megatron_optimizer(OptimizerConfig(**ADAM_B, **scaled), ddps[1], pgc),
        ]
    )
    assert [g["lr"] for g in chain.param_groups] == [0.01, 0.01, 0.02, 0.02]
    rank, outcomes = pgc.rank("dp_cp"), []
    for step in range(3):
        x, y = batch(8, step)
        for ddp in ddps:
            ddp.zero_grad_buffer()
        chain.scale_loss(loss_of(ddps[0], ddps[1], x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])).backward()
        for ddp in ddps:
            ddp.finish_grad_sync()
        if step == 2 and dist.get_rank() == 1:
            top.bias.main_grad[0] = float("nan")  # one member, one rank
        before = [p.detach().clone() for p in [*body.parameters(), *top.parameters()]]
        outcomes.append(chain.step())
        if step == 2:
            assert all(torch.equal(b, p) for b, p in zip(before, [*body.parameters(), *top.parameters()], strict=True))
            break
        for opt in ref_opts:
            opt.zero_grad()
        loss_of(ref_body, ref_top, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_([*ref_body.parameters(), *ref_top.parameters()], CLIP)
        for opt in ref_opts:
            opt.step()
        assert outcomes[-1][1] == pytest.approx(float(ref_norm), rel=1e-5)
        for param, ref_param in zip(
            [*body.parameters(), *top.parameters()], [*ref_body.parameters(), *ref_top.parameters()], strict=True
        ):
            torch.testing.assert_close(param, ref_param, rtol=1e-5, atol=1e-6)
    return [ok for ok, _, _ in outcomes], chain.get_loss_scale(), len(chain.state_dict())


def test_chain_uses_one_grad_norm_and_skips_every_member_together():
    # the shared scaler halved once for the overflow, though two members saw it
    assert run_distributed(_chain_agrees_on_norm_and_skip, 2) == [([True, True, False], 2.0, 2)] * 2


def _mismatches_are_rejected():
    pgc = dp_collection(1)
    scaled = get_megatron_optimizer(OptimizerConfig(lr=1.0, fp16=True), tiny_mlp(), pgc)
    plain = get_megatron_optimizer(OptimizerConfig(lr=1.0), head(), pgc)
    with pytest.raises(
        OptimizerConfigError,
        match=r"chained optimizers disagree on loss scaling \(member has a loss "
        r"scaler: \[True, False\]\); use the same fp16 / loss_scale settings for every member",
    ):
        ChainedOptimizer([scaled, plain])
    with pytest.raises(OptimizerConfigError, match=r"ChainedOptimizer needs at least one optimizer, got an empty list"):
        ChainedOptimizer([])
    chain = ChainedOptimizer([plain])
    with pytest.raises(OptimizerConfigError, match=r"chained optimizer state has 2 members but this chain has 1"):
        chain.load_state_dict([plain.state_dict(), plain.state_dict()])


def test_mismatched_members_and_states_are_rejected():
    run_distributed(_mismatches_are_rejected, 1)


def _agree_with_a_remote_member(remote: list[float], asked: list):
    """An ``agree`` for a rank whose job holds one more member, which reports ``remote`` in turn."""
    remote_values = iter(remote)

    def agree(values):
        asked.append(values)
        return [*values, next(remote_values)]

    return agree


def _agreement_decides_skip_norm_and_zero_count():
    config = OptimizerConfig(
        optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0, log_num_zeros_in_grad=True
    )
    outcomes, asked = [], []
    for remote in ([0.0, 16.0, 7.0], [1.0]):  # (no overflow, squared norm 4^2, 7 zeros), then an overflow
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        model.weight.grad = torch.tensor([[3.0, 0.0]])
        optimizer = get_megatron_optimizer(config, model, dp_collection(1))
        agree = _agree_with_a_remote_member(remote, asked)
        outcomes.append((step_optimizers([optimizer], agree=agree), model.weight.detach().tolist()))
    return outcomes, asked


def test_the_agreement_function_decides_skip_norm_and_zero_count():
    (stepped, skipped), asked = run_distributed(_agreement_decides_skip_norm_and_zero_count, 1)[0]
    assert stepped == ((True, 5.0, 8), [[-2.0, 1.0]])  # norm sqrt(3^2 + 4^2), zeros 1 + 7
    assert skipped == ((False, None, None), [[1.0, 1.0]])
    assert asked == [[0.0], [9.0], [1.0], [0.0]]  # overflow flag, squared norm, zeros; then the flag only
