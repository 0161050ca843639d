"""Gradient accumulation fusion on CUDA, where it is on by default: ``addmm`` with an fp32
``out_dtype`` adds the product of bf16 operands (the transposed output gradient and the input, as
the backward passes them) into its fp32 view of the flat buffer in place; bf16 linears under DDP
with an fp32 ``main_grad`` accumulate through it over micro-batches, and their gradients agree
with the unfused path (bf16 weight gradients added by DDP's hook) and with an fp64 reference, the
fused ones at least as closely."""

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.main_grad import add_product_to_main_grad, fusable_main_grad
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.distributed.test_gradient_accumulation_fusion import (
    MICRO_BATCHES,
    _backward_micro_batches,
    _block,
    _FusedCalls,
)

pytestmark = pytest.mark.gpu(1)


def test_addmm_with_fp32_out_dtype_accumulates_bf16_products_in_place():
    gen = torch.Generator(device="cuda").manual_seed(0)
    buffer = torch.randn(1000 + 64 * 48, device="cuda", generator=gen)
    main_grad = buffer[1000:].view(64, 48)  # a parameter's view of the flat buffer
    before, head = main_grad.clone(), buffer[:1000].clone()
    grad_out = torch.randn(300, 64, device="cuda", generator=gen).bfloat16()
    x = torch.randn(300, 48, device="cuda", generator=gen).bfloat16()
    weight = torch.nn.Parameter(torch.empty(64, 48, device="cuda", dtype=torch.bfloat16))
    weight.main_grad = main_grad
    assert fusable_main_grad(weight, torch.bfloat16)
    add_product_to_main_grad(main_grad, grad_out.t(), x)
    assert main_grad.data_ptr() == buffer[1000:].data_ptr() and main_grad.dtype == torch.float32
    expected = before.double() + grad_out.double().t() @ x.double()
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(buffer[:1000], head)  # nothing outside the view is touched


def _bf16_grads():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(1))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    reference = _block(pgc).double()
    runs = {}
    for fused in (True, False):
        model = _block(pgc, bf16=True, gradient_accumulation_fusion=fused).to(device())
        ddp = DistributedDataParallel(model.fc1.config, ddp_config, model, pg_collection=pgc)
        with pytest.MonkeyPatch.context() as monkeypatch:
            calls = _FusedCalls(monkeypatch)
            _backward_micro_batches(lambda x, model=model: model(x.to(device(), torch.bfloat16)).float().cpu(), ddp)
        runs[fused] = calls.count, {n: p.main_grad.double().cpu() for n, p in model.named_parameters()}
    reference.load_state_dict({n: p.double() for n, p in model.state_dict().items()})
    _backward_micro_batches(lambda x: reference(x.to(torch.bfloat16).double()))
    return runs, {n: p.grad for n, p in reference.named_parameters()}


def test_bf16_linears_accumulate_fp32_wgrads_close_to_the_unfused_path():
    runs, reference = run_distributed(_bf16_grads, 1)[0]
    (fused_calls, fused), (unfused_calls, unfused) = runs[True], runs[False]
    assert (fused_calls, unfused_calls) == (2 * MICRO_BATCHES, 0)
    for name, expected in reference.items():
        scale = expected.abs().max()
        torch.testing.assert_close(fused[name], unfused[name], rtol=2e-2, atol=2e-2 * scale)
        torch.testing.assert_close(fused[name], expected, rtol=2e-2, atol=2e-2 * scale)
        if name.endswith("weight"):
            assert (fused[name] - expected).norm() <= 1.1 * (unfused[name] - expected).norm()
