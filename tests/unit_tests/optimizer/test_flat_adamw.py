"""The mixed-precision and distributed optimizers step with FlatAdamW (one kernel per DDP buffer)
where the fused ``adamw`` op runs on Triton (CUDA; here Triton's interpreter): the same norms,
skipped steps, masters and step counts as torch's fused AdamW on real DP2 gloo ranks, the
parameters written by the kernel, and a saved state that continues the run."""

from __future__ import annotations

import io

import pytest
import torch

from megatron.core.fusions import fusion_backend
from megatron.core.optimizer.flat_adamw import FlatAdamW
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.optimizer.toy_models import batch, build, dp2_grads, dp_collection, loss_fn, tiny_mlp


def _within_one_ulp(param: torch.Tensor, master: torch.Tensor) -> bool:
    """``param`` is ``master`` rounded to bf16 (exactly on CUDA; Triton's interpreter truncates)."""
    if param.is_cuda:
        return torch.equal(param, master.to(param.dtype))
    return bool(torch.all((param.float() - master).abs() <= torch.finfo(param.dtype).eps * master.abs()))


def _flat_matches_torch_fused(distributed_optimizer, dtype):
    """fp32: the same run as torch's fused AdamW (norms, skipped step, masters, step counts).
    bf16: after every step each parameter is its master rounded (the kernel's copy, gathered
    to every replica by the distributed optimizer); the runs then differ by the rounding of
    Triton's interpreter, so only the first step's norm is compared."""
    pgc = dp_collection(2)
    runs = []
    for backend in ("triton", "torch"):
        model = tiny_mlp(dtype)
        options = dict(distributed_optimizer=distributed_optimizer, clip_grad=0.05, bf16=dtype == torch.bfloat16)
        with fusion_backend(backend):
            ddp, opt = build(model, pgc, fused=backend == "torch", grad_reduce_in_fp32=True, **options)
        assert isinstance(opt.optimizer, FlatAdamW) == (backend == "triton") and opt.steps_fused()
        outcomes = []
        for step in range(4):
            dp2_grads(ddp, opt, pgc, step, nan=step == 2, dtype=dtype)
            outcomes.append(opt.step())
            assert all(_within_one_ulp(e.model_view(e.model_param.detach()), e.master) for e in opt.master_params)
        params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        replicas = [torch.empty_like(params) for _ in range(2)]
        torch.distributed.all_gather(replicas, params, group=pgc.dp_cp)
        assert torch.equal(replicas[0], replicas[1])
        steps = sorted({float(state["step"]) for state in opt.optimizer.state.values()})
        masters = {id(e.model_param): e.master for e in opt.master_params}
        runs.append((outcomes, [masters[id(p)].clone() for p in model.parameters() if id(p) in masters], steps))
    (outcomes, masters, steps), (torch_outcomes, torch_masters, torch_steps) = runs
    assert [ok for ok, _, _ in outcomes] == [ok for ok, _, _ in torch_outcomes] == [True, True, False, True]
    assert steps == torch_steps == [3.0]
    norms, torch_norms = [n for _, n, _ in outcomes], [n for _, n, _ in torch_outcomes]
    if dtype == torch.bfloat16:
        return norms[0] == pytest.approx(torch_norms[0], rel=1e-6)
    assert norms == pytest.approx(torch_norms, rel=1e-6)
    for master, torch_master in zip(masters, torch_masters, strict=True):
        torch.testing.assert_close(master, torch_master, rtol=2e-6, atol=1e-7)
    return norms[0] > 0.05  # clipping was active


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_flat_adamw_steps_ddp_buffers_like_torch_fused_adamw(distributed_optimizer, dtype):
    assert run_distributed(_flat_matches_torch_fused, 2, distributed_optimizer, dtype) == [True, True]


def _flat_state_round_trip():
    pgc = dp_collection(1)
    model, twin = tiny_mlp(torch.bfloat16), tiny_mlp(torch.bfloat16, seed=1)
    with fusion_backend("triton"):
        ddp, opt = build(model, pgc, bf16=True, grad_reduce_in_fp32=True)
        twin_ddp, twin_opt = build(twin, pgc, bf16=True, grad_reduce_in_fp32=True)
    for step in range(2):
        x, y = batch(4, step, torch.bfloat16)
        ddp.zero_grad_buffer()
        loss_fn(ddp, x, y).backward()
        ddp.finish_grad_sync()
        opt.step()
    twin.load_state_dict(model.state_dict())
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    twin_opt.load_state_dict(torch.load(saved, weights_only=True))
    x, y = batch(4, 7, torch.bfloat16)
    for d, o in ((ddp, opt), (twin_ddp, twin_opt)):
        d.zero_grad_buffer()
        loss_fn(d, x, y).backward()
        d.finish_grad_sync()
        o.step()
    for mine, theirs in zip(opt.master_params, twin_opt.master_params, strict=True):
        assert torch.equal(mine.master, theirs.master)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    return isinstance(twin_opt.optimizer, FlatAdamW)


def test_a_saved_flat_adamw_state_continues_the_run_identically():
    assert run_distributed(_flat_state_round_trip, 1) == [True]
