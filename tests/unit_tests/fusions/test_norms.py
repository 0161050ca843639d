"""The fused norm kernels (LayerNorm / RMSNorm, alone or after a residual bias-dropout-add)
against the torch reference, forward and backward, fp32 and bf16, at widths that are not
powers of two; Philox dropout against its own definition."""

import pytest
import torch

from megatron.core.fusions import bias_dropout_add, bias_dropout_add_norm, fusion_backend, norm
from megatron.core.fusions.norms import layer_norm_reference, norm_and_residual, rms_norm_reference
from tests.unit_tests.fusions.kernels import DEVICE, assert_triton_matches_torch, leaf

KINDS = ("LayerNorm", "RMSNorm")
DTYPES = (torch.float32, torch.bfloat16)


def _norm_inputs(kind, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = leaf(3, 5, n, dtype=dtype, generator=gen)
    weight = (1 + 0.2 * torch.randn(n, generator=gen)).to(DEVICE, dtype).requires_grad_()
    norm_bias = leaf(n, dtype=dtype, generator=gen) if kind == "LayerNorm" else None
    return x, weight, norm_bias, gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [37, 256])
def test_norm_matches_reference(kind, n, dtype):
    x, weight, norm_bias, _ = _norm_inputs(kind, n, dtype)
    assert_triton_matches_torch(lambda x, w, b: norm(x, w, b, 1e-5, kind), [x, weight, norm_bias], dtype)


@pytest.mark.parametrize(
    ("kind", "dtype", "residual_used"),
    [("LayerNorm", torch.float32, True), ("RMSNorm", torch.bfloat16, True), ("LayerNorm", torch.bfloat16, False)],
)
def test_norm_and_residual_adds_the_residual_gradient_in_the_norm_backward(kind, dtype, residual_used):
    # The residual output's cotangent must reach x added to the norm's input gradient (one
    # kernel on Triton, autograd's sum on torch); unused, the norm's gradient alone.
    x, weight, norm_bias, _ = _norm_inputs(kind, 100, dtype)

    def both(x, w, b):
        residual, out = norm_and_residual(x, w, b, 1e-5, kind)
        return (residual * 1, out) if residual_used else out

    assert_triton_matches_torch(both, [x, weight, norm_bias], dtype)
    with fusion_backend("triton"):
        residual, _ = norm_and_residual(x, weight, norm_bias, 1e-5, kind)
    assert torch.equal(residual, x) and residual.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_residual_add_and_norm_match_reference(kind, dtype, with_bias):
    x, weight, norm_bias, gen = _norm_inputs(kind, 100, dtype)
    residual = leaf(3, 5, 100, dtype=dtype, generator=gen)
    bias = leaf(100, dtype=dtype, generator=gen) if with_bias else None

    def fused(x, residual, bias, weight, norm_bias):
        return bias_dropout_add_norm(x, bias, residual, 0.0, True, False, weight, norm_bias, 1e-5, kind)

    assert_triton_matches_torch(fused, [x, residual, bias, weight, norm_bias], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_matches_reference_without_dropout(dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual, bias = leaf(4, 2, 33, dtype=dtype, generator=gen), leaf(4, 2, 33, dtype=dtype, generator=gen), None
    assert_triton_matches_torch(lambda x, r: bias_dropout_add(x, bias, r, 0.1, False), [x, residual], dtype)
    bias = leaf(33, dtype=dtype, generator=gen)
    assert_triton_matches_torch(lambda x, r, b: bias_dropout_add(x, b, r, 0.0, True), [x, residual, bias], dtype)


def test_dropout_keeps_about_1_minus_p_scaled_and_backward_uses_the_forward_mask():
    p = 0.25
    x = leaf(16, 4, 96)
    bias = leaf(96)
    residual = leaf(16, 4, 96)
    weight = torch.ones(96, device=DEVICE, requires_grad=True)
    with fusion_backend("triton"):
        torch.manual_seed(3)
        out, normed = bias_dropout_add_norm(x, bias, residual, p, True, False, weight, None, 1e-5, "RMSNorm")
        torch.manual_seed(3)
        again, _ = bias_dropout_add_norm(x, bias, residual, p, True, False, weight, None, 1e-5, "RMSNorm")
    assert torch.equal(out, again)  # the mask is a function of the seed drawn from torch's RNG
    pre = (x + bias).detach()
    kept = (out - residual).detach() != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.03
    torch.testing.assert_close((out - residual)[kept], (pre / (1 - p))[kept], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed, rms_norm_reference(out, weight, 1e-5), rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    out.backward(upstream, retain_graph=True)
    torch.testing.assert_close(residual.grad, upstream)
    torch.testing.assert_close(x.grad, upstream * kept / (1 - p), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.grad, (upstream * kept / (1 - p)).sum((0, 1)), rtol=1e-4, atol=1e-4)


def test_forward_only_calls_build_no_graph_and_give_the_same_result():
    x, weight, norm_bias, _ = _norm_inputs("LayerNorm", 48, torch.float32)
    with fusion_backend("triton"):
        with_grad = norm(x, weight, norm_bias, 1e-5, "LayerNorm")
        with torch.inference_mode():
            bare = norm(x, weight, norm_bias, 1e-5, "LayerNorm")
    assert with_grad.grad_fn is not None and bare.grad_fn is None
    assert torch.equal(with_grad.detach(), bare)
    torch.testing.assert_close(bare, layer_norm_reference(x, weight, norm_bias, 1e-5).detach(), rtol=1e-5, atol=1e-5)
