"""--attention-backend: which SDPA kernel core attention runs (seen by the profiler), and
that every allowed kernel gives the plain math's outputs and gradients (on CUDA: cuDNN, flash,
and the "auto" order on the packed QKV layout the layers pass)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from megatron.core.config import ATTENTION_BACKENDS, ConfigError, TransformerConfig
from megatron.core.transformer.attention import DotProductAttention, sdpa_backends
from megatron.training.arguments import build_parser, transformer_config_from_args

KERNELS = {  # aten op of each SDPA kernel (as the profiler records it) -> its kernel family
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_efficient_attention": "efficient",
}


def _kernels_run(events) -> list[str]:
    return [KERNELS[e.name[len("aten::") :]] for e in events if e.name[len("aten::") :] in KERNELS]


def _config(backend: str, heads: int = 4, groups: int = 2) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=64 * heads,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_backend=backend,
    )


def _packed_qkv(device, heads: int, groups: int, dtype, seq: int = 128, batch: int = 2, head_dim: int = 64):
    """q, k, v [s, b, n, d] as the layer passes them: views of one packed projection."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(seq, batch, (heads + 2 * groups) * head_dim, generator=gen).to(device, dtype)
    qkv.requires_grad_()
    parts = qkv.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
    return qkv, [t.unflatten(-1, (-1, head_dim)) for t in parts]


def _run(device, backend: str, heads: int, groups: int, dtype, compiler: str | None = None):
    """Output, packed-QKV gradient, the kernels that ran and every aten op recorded, under
    ``backend``; with ``compiler``, through ``torch.compile(backend=compiler)`` (as
    ``--use-torch-compile`` compiles the layers), profiled after the compiling call."""
    attention = DotProductAttention(_config(backend, heads, groups), layer_number=1)
    qkv, (q, k, v) = _packed_qkv(device, heads, groups, dtype)
    if compiler is not None:
        attention = torch.compile(attention, backend=compiler, fullgraph=True)
        attention(q, k, v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = attention(q, k, v)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (grad,) = torch.autograd.grad(out, qkv, cotangent)
    return out, grad, _kernels_run(profile.events()), {e.name for e in profile.events()}


def test_each_backend_names_its_kernels():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sdpa_backends("auto", cuda) == [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert sdpa_backends("fused", cuda) == [SDPBackend.CUDNN_ATTENTION]
    assert sdpa_backends("flash", cpu) == sdpa_backends("flash", cuda) == [SDPBackend.FLASH_ATTENTION]
    assert sdpa_backends("unfused", cpu) == sdpa_backends("local", cuda) == [SDPBackend.MATH]
    assert sdpa_backends("auto", cpu) is None and sdpa_backends("fused", cpu) is None  # SDPA's own choice


def test_an_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="attention_backend must be one of auto, flash, fused, unfused, local"):
        _config("cudnn")


def test_the_flag_reaches_the_config_and_defaults_to_auto():
    parser = build_parser("gpt")
    base = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4"]
    for backend in ATTENTION_BACKENDS:
        args = parser.parse_args([*base, "--attention-backend", backend])
        assert transformer_config_from_args(args).attention_backend == backend
    assert parser.parse_args(base).attention_backend == "auto"


@pytest.mark.parametrize("backend,kernel", [("unfused", "math"), ("local", "math"), ("flash", "flash")])
def test_cpu_runs_the_kernel_asked_for_with_the_math_results(backend, kernel):
    cpu = torch.device("cpu")
    out, grad, kernels, _ = _run(cpu, backend, 4, 2, torch.float32)
    assert kernels == [kernel]
    want_out, want_grad, _, _ = _run(cpu, "unfused", 4, 2, torch.float32)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["unfused", "flash"])
def test_compiled_attention_runs_the_kernel_asked_for(backend):
    """Dynamo traces the backend context: a compiled layer honours the flag too. (SDPA's own CPU
    choice is flash, so "unfused" shows the flag is not ignored: its math is traced as matmuls.)"""
    cpu = torch.device("cpu")
    out, grad, kernels, ops = _run(cpu, backend, 4, 2, torch.float32, compiler="aot_eager")
    if backend == "flash":
        assert kernels == ["flash"]
    else:
        assert kernels == [] and "aten::bmm" in ops
    want_out, want_grad, _, _ = _run(cpu, "unfused", 4, 2, torch.float32)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)


def test_a_recompile_with_dynamic_shapes_still_traces():
    """A second compile of the layer code with other head counts makes Dynamo mark the shapes
    dynamic; whether heads are grouped (GQA) must stay a plain bool for SDPA, not a symbol."""
    cpu = torch.device("cpu")
    for heads, groups in ((4, 2), (8, 8), (8, 2)):
        out, _, kernels, _ = _run(cpu, "flash", heads, groups, torch.float32, compiler="aot_eager")
        want, _, _, _ = _run(cpu, "unfused", heads, groups, torch.float32)
        assert kernels == ["flash"]
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("heads,groups", [(16, 16), (16, 4)])
@pytest.mark.parametrize("backend,kernel", [("auto", "cudnn"), ("fused", "cudnn"), ("flash", "flash")])
def test_cuda_kernels_give_the_math_results_on_the_packed_layout(backend, kernel, heads, groups):
    cuda = torch.device("cuda")
    out, grad, kernels, _ = _run(cuda, backend, heads, groups, torch.bfloat16)
    assert kernels == [kernel]  # "auto": cuDNN first on the card
    # The reference: fp32 math on the same bf16 inputs.
    attention = DotProductAttention(_config("unfused", heads, groups), layer_number=1)
    qkv, (q, k, v) = _packed_qkv(cuda, heads, groups, torch.bfloat16)
    q, k, v = (t.float() for t in (q, k, v))
    want = attention(q, k, v)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(cuda)
    (want_grad,) = torch.autograd.grad(want, qkv, cotangent)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("backend,kernel", [("auto", "cudnn"), ("flash", "flash")])
def test_layers_compiled_by_inductor_run_the_kernel_asked_for(backend, kernel):
    cuda = torch.device("cuda")
    out, grad, kernels, _ = _run(cuda, backend, 16, 4, torch.bfloat16, compiler="inductor")
    assert kernels == [kernel]
    want_out, want_grad, _, _ = _run(cuda, backend, 16, 4, torch.bfloat16)
    torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, want_grad, rtol=5e-2, atol=5e-2)
