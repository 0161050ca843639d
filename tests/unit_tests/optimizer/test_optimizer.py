"""MegatronOptimizer: steps equal torch AdamW on the full batch, fp32 and bf16 with master
weights; fp16 loss scaling and skipped steps agreed on every rank; state round trip."""

import io

import pytest
import torch
import torch.distributed as dist

from megatron.core.fusions import fusion_backend
from megatron.core.optimizer import (
    DynamicGradScaler,
    MegatronOptimizer,
    OptimizerConfig,
    OptimizerConfigError,
    get_megatron_optimizer,
    step_optimizers,
)
from megatron.core.optimizer.flat_adamw import FlatAdamW
from megatron.core.optimizer.optimizer import members_agree
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.optimizer.toy_models import (
    ADAM,
    batch,
    build,
    dp2_grads,
    dp_collection,
    loss_fn,
    reference_training,
    tiny_mlp,
    torch_adamw,
    train_dp,
)

STEPS = 3


def _fp32_steps_match_torch_adamw():
    pgc = dp_collection(2)
    model = tiny_mlp()
    ref, ref_norms = reference_training(model, 8, STEPS, clip_grad=0.05)
    ddp, opt = build(model, pgc, clip_grad=0.05)
    results = train_dp(ddp, opt, pgc, STEPS)
    assert [ok for ok, _, _ in results] == [True] * STEPS
    assert [norm for _, norm, _ in results] == pytest.approx(ref_norms, rel=1e-5)
    assert ref_norms[0] > 0.05  # clipping was active
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param, ref_param, rtol=1e-5, atol=1e-6, msg=name)
    return [group["weight_decay"] for group in opt.param_groups]


def test_fp32_adamw_on_dp2_equals_torch_adamw_on_full_batch():
    assert run_distributed(_fp32_steps_match_torch_adamw, 2) == [[0.1, 0.0]] * 2


def _bf16_master_weights_match_torch_adamw():
    pgc = dp_collection(2)
    model = tiny_mlp(torch.bfloat16)
    ref = tiny_mlp(torch.bfloat16).float()  # fp32 copy of the bf16 starting values
    ref_opt = torch_adamw(ref.parameters(), **ADAM)
    ddp, opt = build(model, pgc, clip_grad=0.0, bf16=True)
    rank = pgc.rank("dp_cp")
    for step in range(STEPS):
        x, y = batch(8, step, torch.bfloat16)
        ddp.zero_grad_buffer()
        loss_fn(ddp, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]).backward()
        ddp.finish_grad_sync()
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            ref_param.grad = param.main_grad.float().clone()  # the same (bf16) gradients
        assert opt.step()[0]
        ref_opt.step()
    masters = {id(e.model_param): e.master for e in opt.master_params}
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        assert param.dtype == torch.bfloat16 and masters[id(param)].dtype == torch.float32
        torch.testing.assert_close(masters[id(param)], ref_param.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(param.detach(), ref_param.detach().bfloat16(), rtol=0, atol=0)
    return opt.state_numel()


def test_bf16_master_weights_step_like_torch_adamw_in_fp32():
    sizes = run_distributed(_bf16_master_weights_match_torch_adamw, 2)
    assert sizes == [{"master_params": 67, "exp_avg": 67, "exp_avg_sq": 67}] * 2


def _fp16_scaling_and_skipped_step():
    pgc = dp_collection(2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(device(), torch.float16)
    config = OptimizerConfig(
        fp16=True, initial_loss_scale=16.0, loss_scale_window=2, hysteresis=1, clip_grad=0.0, **ADAM
    )
    opt = get_megatron_optimizer(config, model, pgc)
    ref = torch.nn.Linear(3, 2).to(device())
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref_opt = torch_adamw(ref.parameters(), **ADAM)
    scales, outcomes = [], []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen).to(device()) for p in model.parameters()]
        for param, ref_param, grad in zip(model.parameters(), ref.parameters(), grads, strict=True):
            param.grad = (grad * opt.get_loss_scale()).half()  # as if the scaled loss was back-propagated
            ref_param.grad = grad.half().float()
        if step == 2 and dist.get_rank() == 1:
            model.bias.grad[0] = float("inf")  # only one rank overflows
        before = [p.detach().clone() for p in model.parameters()]
        outcomes.append(opt.step())
        if step < 2:
            ref_opt.step()
            for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(param.detach(), ref_param.detach().half(), rtol=1e-3, atol=1e-4)
        else:
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        scales.append(opt.get_loss_scale())
    return [ok for ok, _, _ in outcomes], scales


def test_fp16_loss_scale_grows_and_halves_and_an_inf_on_one_rank_skips_every_rank():
    # window 2: the scale doubles after two clean steps; hysteresis 1: the first overflow halves it
    assert run_distributed(_fp16_scaling_and_skipped_step, 2) == [([True, True, False], [16.0, 32.0, 16.0])] * 2


def _bf16_nonfinite_gradient_skips_through_the_norm(distributed_optimizer):
    pgc = dp_collection(2)
    model = tiny_mlp(torch.bfloat16)
    ddp, opt = build(model, pgc, distributed_optimizer=distributed_optimizer, clip_grad=1.0, bf16=True)
    outcomes = []
    for step in range(3):
        dp2_grads(ddp, opt, pgc, step, nan=step == 1)
        before = [p.detach().clone() for p in model.parameters()]
        outcomes.append(opt.step())
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert unchanged == (step == 1), step
    return [ok for ok, _, _ in outcomes], outcomes[1]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_bf16_without_a_scaler_skips_a_nonfinite_step_on_every_rank(distributed_optimizer):
    """No loss scaler: no unscale pass; the global grad norm finds the nan and every rank skips."""
    results = run_distributed(_bf16_nonfinite_gradient_skips_through_the_norm, 2, distributed_optimizer)
    assert results == [([True, False, True], (False, None, None))] * 2


def _fused_adamw_clips_through_grad_scale():
    pgc = dp_collection(1)
    runs = []
    for fused in (False, True):
        model = tiny_mlp()
        ddp, opt = build(model, pgc, clip_grad=0.05, fused=fused)
        results = train_dp(ddp, opt, pgc, STEPS)
        assert opt.optimizer.grad_scale is None  # the clipping factor never outlives its step
        runs.append(([norm for _, norm, _ in results], [p.detach().clone() for p in model.parameters()]))
    (norms, params), (fused_norms, fused_params) = runs
    assert norms[0] > 0.05 and fused_norms == pytest.approx(norms, rel=1e-6)
    for param, fused_param in zip(params, fused_params, strict=True):
        torch.testing.assert_close(fused_param, param, rtol=1e-6, atol=1e-7)


def test_fused_adamw_applies_the_clipping_factor_as_its_grad_scale():
    run_distributed(_fused_adamw_clips_through_grad_scale, 1)


def _device_decisions_match_host_decisions(distributed_optimizer):
    """Fused AdamW without a loss scaler decides clipping and skipping on the device (no host
    sync before the update); forcing the host path (an ``agree`` other than the default) must
    give the same bits: norms, parameters, masters and step counts, a nan step included."""
    pgc = dp_collection(2)
    runs = []
    for agree in (members_agree, lambda values: list(values)):
        model = tiny_mlp(torch.bfloat16)
        ddp, opt = build(model, pgc, distributed_optimizer=distributed_optimizer, clip_grad=0.05, bf16=True, fused=True)
        assert opt.grad_scaler is None and opt.steps_fused()  # what the device path needs
        outcomes = []
        for step in range(4):
            dp2_grads(ddp, opt, pgc, step, nan=step == 2)
            outcomes.append(step_optimizers([opt], agree=agree))
        assert opt.optimizer.grad_scale is None and getattr(opt.optimizer, "found_inf", None) is None
        steps = [float(state["step"]) for state in opt.optimizer.state.values()]
        runs.append(
            (
                outcomes,
                [p.detach().clone() for p in model.parameters()],
                [e.master.clone() for e in opt.master_params],
                steps,
            )
        )
    (outcomes, params, masters, steps), (host_outcomes, host_params, host_masters, host_steps) = runs
    assert outcomes == host_outcomes and outcomes[2] == (False, None, None) and outcomes[0][1] > 0.05
    assert steps == host_steps == [3.0] * len(steps)
    assert all(torch.equal(a, b) for a, b in zip(params + masters, host_params + host_masters, strict=True))
    return [ok for ok, _, _ in outcomes]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_fused_adamw_decides_clipping_and_skipping_on_the_device_with_the_host_bits(distributed_optimizer):
    results = run_distributed(_device_decisions_match_host_decisions, 2, distributed_optimizer)
    assert results == [[True, True, False, True]] * 2


def test_dynamic_scaler_waits_for_hysteresis_and_respects_the_floor():
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    history = []
    for found_inf in [True, False, True, True, True, False, False, False]:
        scaler.update(found_inf)
        history.append(scaler.scale)
    # 1st overflow spends hysteresis; a clean step does not refill it; then halving to the floor;
    # three clean steps grow it
    assert history == [8.0, 8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 4.0]
    restored = DynamicGradScaler(initial_scale=1.0, min_scale=1.0)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def _state_round_trip(backend):
    pgc = dp_collection(1)
    model, twin = tiny_mlp(torch.bfloat16), tiny_mlp(torch.bfloat16)
    with fusion_backend(backend):  # "triton": FlatAdamW (Triton's interpreter on CPU)
        ddp, opt = build(model, pgc, bf16=True, grad_reduce_in_fp32=True)
        twin_ddp, twin_opt = build(twin, pgc, bf16=True, grad_reduce_in_fp32=True)
    assert isinstance(twin_opt.optimizer, FlatAdamW) == (backend == "triton")
    train_dp(ddp, opt, pgc, 2)
    twin.load_state_dict(model.state_dict())
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # plain tensors and scalars: loads with weights_only
    saved.seek(0)
    twin_opt.load_state_dict(torch.load(saved, weights_only=True))
    state = opt.state_dict()["optimizer"]
    assert sorted(state["state"]) == list(range(4)) and state["param_groups"][1]["wd_mult"] == 0.0
    # one more step of each from the same state gives the same fp32 masters
    x, y = batch(4, 7, torch.bfloat16)
    for d, o in ((ddp, opt), (twin_ddp, twin_opt)):
        d.zero_grad_buffer()
        loss_fn(d, x, y).backward()
        d.finish_grad_sync()
        o.step()
    for mine, theirs in zip(opt.master_params, twin_opt.master_params, strict=True):
        torch.testing.assert_close(mine.master, theirs.master, rtol=0, atol=0)
    # reload_model_params: masters follow model weights loaded from elsewhere
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    opt.reload_model_params()
    masters = {id(e.model_param): e.master for e in opt.master_params}
    assert torch.equal(masters[id(model[0].weight)].cpu(), torch.full((8, 4), 0.5))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_state_dict_round_trip_continues_identically(backend):
    run_distributed(_state_round_trip, 1, backend)


def test_config_errors_name_the_field():
    with pytest.raises(OptimizerConfigError, match=r"lr must be set to a number >= 0, got None"):
        OptimizerConfig()
    with pytest.raises(OptimizerConfigError, match=r"optimizer must be one of adam, sgd, muon, got 'lamb'"):
        OptimizerConfig(optimizer="lamb", lr=1.0)
    with pytest.raises(OptimizerConfigError, match=r"hysteresis must be an integer >= 1, got 0"):
        OptimizerConfig(lr=1.0, hysteresis=0)


def _mismatched_ddp_is_rejected():
    pgc = dp_collection(1)
    with pytest.raises(
        OptimizerConfigError,
        match=r"model chunk 0: OptimizerConfig.use_distributed_optimizer is True "
        r"but the chunk is not a DistributedDataParallel with ddp_config.use_distributed_optimizer=True",
    ):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), [tiny_mlp()], pgc)
    assert isinstance(get_megatron_optimizer(OptimizerConfig(lr=1.0), tiny_mlp(), pgc), MegatronOptimizer)


def test_distributed_optimizer_without_sharded_ddp_is_rejected():
    run_distributed(_mismatched_ddp_is_rejected, 1)
