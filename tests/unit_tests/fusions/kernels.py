"""Shared pieces of the fused-kernel tests: the device the kernels run on (CUDA, else CPU
under Triton's interpreter, which tests/conftest.py switches on) and the comparison of a fused
op with its torch reference."""

from __future__ import annotations

import torch

from megatron.core.fusions import fusion_backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def leaf(*shape, dtype=torch.float32, scale=1.0, generator=None):
    """A random leaf tensor on DEVICE that requires grad."""
    x = scale * torch.randn(*shape, generator=generator)
    return x.to(DEVICE, dtype).requires_grad_()


def outputs_and_grads(fn, inputs, backend: str, seed: int = 0, cotangent_dtype=None):
    """Outputs of ``fn(*inputs)`` on ``backend`` and the inputs' gradients for a fixed random
    cotangent per output (the same for every backend; rounded to ``cotangent_dtype`` first)."""
    for t in inputs:
        if t is not None:
            t.grad = None
    with fusion_backend(backend):
        out = fn(*inputs)
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
    gen = torch.Generator().manual_seed(seed)
    cotangents = [
        torch.randn(t.shape, generator=gen).to(cotangent_dtype or t.dtype).to(t.device, t.dtype) for t in outs
    ]
    torch.autograd.backward(outs, cotangents)
    grads = [t.grad for t in inputs if t is not None and t.requires_grad]
    return [t.detach() for t in outs], grads


def assert_triton_matches_torch(fn, inputs, dtype):
    """The Triton path of ``fn`` agrees with its torch path, outputs and gradients: in fp32 to
    rounding order; in bf16 to bf16 precision, i.e. its error against the fp64 reference on
    the same inputs is within twice the bf16 reference's own error plus a few bf16 ulps (the
    reference rounds after every op, the kernels once)."""
    ref_out, ref_grads = outputs_and_grads(fn, inputs, "torch")
    out, grads = outputs_and_grads(fn, inputs, "triton")
    assert len(out) == len(ref_out) and len(grads) == len(ref_grads)
    if dtype == torch.float32:
        for got, want in zip(out + grads, ref_out + ref_grads, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, **FP32_TOLERANCE)
        return
    wide = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    truth_out, truth_grads = outputs_and_grads(fn, wide, "torch", cotangent_dtype=dtype)
    for got, want, truth in zip(out + grads, ref_out + ref_grads, truth_out + truth_grads, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        ref_error = (want.double() - truth).abs().max()
        error = (got.double() - truth).abs().max()
        assert error <= 2 * ref_error + 1e-2 * truth.abs().max(), (error.item(), ref_error.item())


def assert_bitwise_equal(fn_a, fn_b, inputs):
    """Two torch implementations give bitwise identical outputs and gradients."""
    out_a, grads_a = outputs_and_grads(fn_a, inputs, "torch")
    out_b, grads_b = outputs_and_grads(fn_b, inputs, "torch")
    for a, b in zip(out_a + grads_a, out_b + grads_b, strict=True):
        assert torch.equal(a, b)
