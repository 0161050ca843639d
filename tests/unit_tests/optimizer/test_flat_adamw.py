"""The mixed-precision and distributed optimizers step with FlatAdamW (one kernel per DDP buffer)
where the fused ``adamw`` op runs on Triton (CUDA; here Triton's interpreter): the same norms,
skipped steps, masters and step counts as torch's fused AdamW on real DP2 gloo ranks, and the
parameters written by the kernel (a saved state continuing the run: test_optimizer's round trip)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fusions import fusion_backend
from megatron.core.optimizer.flat_adamw import FlatAdamW
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.optimizer.toy_models import build, dp2_grads, dp_collection, tiny_mlp


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
