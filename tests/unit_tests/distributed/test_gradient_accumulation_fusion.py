"""Gradient accumulation fusion (:mod:`megatron.core.distributed.main_grad`): under DDP the
column/row-parallel linears' wgrad GEMMs accumulate straight into ``main_grad`` over micro-batches
and give the unfused gradients, which are the plain autograd gradients of the same model; the
input gradients do not change at all; without DDP the layers keep plain ``.grad``; bf16 weights
with fp32 logits (a wide ``output_dtype``) accumulate an fp32 wgrad that is never rounded to bf16;
the placeholder gradient owns no memory. The fused path runs on CPU inside
``fusion_devices("cpu")`` (same-dtype ``addmm_``, the call CUDA makes for fp32 or bf16 buffers of
operands of their own dtype); bf16 operands into an fp32 buffer are the GPU test's. The GPU
benchmark's CPU smoke run finds the same gradients fused and unfused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.main_grad import fusion_devices, is_main_grad_placeholder, main_grad_placeholder
from megatron.core.fusions import fusion_backend
from megatron.core.fusions.backend import FUSED_OPS
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.tensor_parallel.helpers import tp_config

IN, HIDDEN, OUT, MICRO_BATCHES = 6, 10, 4, 3


class _Block(torch.nn.Module):
    """fc2(gelu(fc1(x))) of our parallel linears (TP 1)."""

    def __init__(self, config, pgc):
        super().__init__()
        init = torch.nn.init.normal_
        self.fc1 = ColumnParallelLinear(IN, HIDDEN, config=config, init_method=init, pg_collection=pgc)
        self.fc2 = RowParallelLinear(HIDDEN, OUT, config=config, init_method=init, pg_collection=pgc)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)[0]))[0]


def _micro_batches():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(5, 2, IN, generator=gen), torch.randn(5, 2, OUT, generator=gen)) for _ in range(MICRO_BATCHES)]


def _backward_micro_batches(model, ddp=None):
    """Backward of every micro-batch (all but the last in no_sync); returns the input gradients."""
    input_grads = []
    for index, (x, dout) in enumerate(_micro_batches()):
        x = x.clone().requires_grad_(True)
        last = index == MICRO_BATCHES - 1
        with ddp.no_sync() if ddp is not None and not last else torch.enable_grad():
            (model(x) * dout).sum().backward()
        input_grads.append(x.grad)
    if ddp is not None:
        ddp.finish_grad_sync()
    return input_grads


class _FusedCalls:
    """Counts the fused accumulations (and runs them)."""

    def __init__(self, monkeypatch):
        self.count, accumulate = 0, layers.add_product_to_main_grad

        def counting(*args):
            self.count += 1
            accumulate(*args)

        monkeypatch.setattr(layers, "add_product_to_main_grad", counting)


def _block(pgc, **config):
    torch.manual_seed(0)
    return _Block(tp_config(**config), pgc)


def _ddp_grads(bias_in_gemm):
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(1))
    plain = _block(pgc)
    reference_input_grads = _backward_micro_batches(plain)
    runs = {}
    others = [op for op in FUSED_OPS if op != "linear_bias"]  # the bias in F.linear's GEMM, or added after
    with fusion_backend("triton" if bias_in_gemm else "torch", disabled_ops=others), fusion_devices("cpu"):
        for fused in (True, False):
            model = _block(pgc, gradient_accumulation_fusion=fused)
            ddp = DistributedDataParallel(model.fc1.config, DistributedDataParallelConfig(), model, pg_collection=pgc)
            with pytest.MonkeyPatch.context() as monkeypatch:
                calls = _FusedCalls(monkeypatch)
                input_grads = _backward_micro_batches(model, ddp)
            assert all(p.grad is None for p in model.parameters())
            runs[fused] = calls.count, input_grads, {n: p.main_grad.clone() for n, p in model.named_parameters()}
    return {n: p.grad for n, p in plain.named_parameters()}, reference_input_grads, runs


@pytest.mark.parametrize("bias_in_gemm", [False, True], ids=["bias-added", "bias-in-gemm"])
def test_fused_wgrad_accumulation_over_micro_batches_gives_the_autograd_gradients(bias_in_gemm):
    (expected, reference_input_grads, runs) = run_distributed(_ddp_grads, 1, bias_in_gemm)[0]
    (fused_calls, fused_input_grads, fused), (unfused_calls, unfused_input_grads, unfused) = runs[True], runs[False]
    assert (fused_calls, unfused_calls) == (2 * MICRO_BATCHES, 0)  # both weights, every micro-batch
    for name, grad in expected.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused[name], unfused[name], rtol=1e-6, atol=1e-6)
    for grads in (fused_input_grads, unfused_input_grads):
        for grad, reference in zip(grads, reference_input_grads, strict=True):
            torch.testing.assert_close(grad, reference, rtol=0, atol=0)


def _grads_without_ddp():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(1))
    model, reference = _block(pgc), _block(pgc, gradient_accumulation_fusion=False)
    with pytest.MonkeyPatch.context() as monkeypatch, fusion_devices("cpu"):
        calls = _FusedCalls(monkeypatch)
        _backward_micro_batches(model)
    _backward_micro_batches(reference)
    return calls.count, [p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]


def test_without_ddp_the_layers_keep_plain_autograd_gradients():
    calls, grads, reference = run_distributed(_grads_without_ddp, 1)[0]
    assert calls == 0
    for grad, ref in zip(grads, reference, strict=True):
        torch.testing.assert_close(grad, ref, rtol=0, atol=0)


def _wide_output_grads():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(1))
    config = tp_config(bf16=True)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(
        IN, OUT, config=config, init_method=torch.nn.init.normal_, bias=False, pg_collection=pgc,
        output_dtype=torch.float32,
    )  # fmt: skip
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer, pg_collection=pgc
    )
    expected = torch.zeros(OUT, IN)
    with fusion_devices("cpu"):
        for x, dout in _micro_batches():
            x = x.bfloat16()
            out, _ = layer(x)
            assert out.dtype == torch.float32
            (out * dout).sum().backward()
            expected += dout.reshape(-1, OUT).t() @ x.reshape(-1, IN).float()
    ddp.finish_grad_sync()
    return layer.weight.main_grad, expected


def test_bf16_weight_with_fp32_logits_accumulates_an_fp32_wgrad():
    main_grad, expected = run_distributed(_wide_output_grads, 1)[0]
    assert main_grad.dtype == torch.float32
    # fp32 throughout: no bf16 rounding of any micro-batch's wgrad (that alone would be ~1e-2 off)
    torch.testing.assert_close(main_grad, expected, rtol=1e-5, atol=1e-5)


def test_the_placeholder_owns_no_memory_and_only_it_is_skipped():
    weight = torch.nn.Parameter(torch.randn(3, 5))
    placeholder = main_grad_placeholder(weight)
    assert placeholder.shape == weight.shape and placeholder.dtype == weight.dtype
    assert placeholder.stride() == (0, 0) and not placeholder.any()
    assert is_main_grad_placeholder(placeholder)
    assert not is_main_grad_placeholder(torch.zeros(3, 5))
    assert not is_main_grad_placeholder(placeholder + torch.ones(3, 5))  # a contribution summed with it


def test_benchmark_runs_on_cpu_as_written_and_finds_the_same_gradients(tmp_path):
    """``python -m benchmarks.grad_accumulation_fusion --tiny`` (the GPU benchmark's CPU smoke
    run): both sides train, and the fused gradients equal the unfused ones on the same weights."""
    repo = Path(__file__).resolve().parents[3]
    out = tmp_path / "gaf.json"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "benchmarks.grad_accumulation_fusion", "--tiny", "--json", str(out)]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["gradients_fused_vs_unfused"] == {"relative_l2": 0.0, "worst_param_relative_l2": 0.0}
    assert report["fused"]["step_ms"] > 0 and report["unfused"]["step_ms"] > 0
    assert "speedup fused/unfused:" in done.stdout
