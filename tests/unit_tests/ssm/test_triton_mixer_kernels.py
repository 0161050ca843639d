"""The Triton conv1d + SiLU and gated RMSNorm kernels of the fused mixer path against the torch
reference (:mod:`megatron.core.ssm.mixer_reference`), forward and backward, on the strided
views the mixer hands them: channels cut out of a packed sequence-major in_proj buffer, a
batch-major scan output, gradients written into slices of a NaN-poisoned packed buffer.

Without CUDA the kernels run under Triton's interpreter on CPU tensors (``TRITON_INTERPRET``
must be set before the kernels' modules are imported); with CUDA they run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from megatron.core.ssm import conv1d_triton
from megatron.core.ssm.conv1d_triton import BLOCK_C, BLOCK_T
from megatron.core.ssm.conv1d_triton import conv1d_silu_backward as conv_bwd
from megatron.core.ssm.conv1d_triton import conv1d_silu_forward as conv_fwd
from megatron.core.ssm.gated_norm_triton import gated_rms_norm_backward as norm_bwd
from megatron.core.ssm.gated_norm_triton import gated_rms_norm_forward as norm_fwd
from megatron.core.ssm.mixer_reference import causal_conv1d_silu, gated_rms_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Backward programs walk two token tiles here (fewer than on a GPU) so that a short sequence
# spans two programs with a ragged last tile; the channel count is not a multiple of the tile.
BWD_TILES = 2
SEQ, BATCH = BLOCK_T * BWD_TILES + BLOCK_T + 5, 2
CHANNELS, OFFSET, PACKED = BLOCK_C + 22, 13, BLOCK_C + 60
EPS = 1e-5


@pytest.fixture(autouse=True)
def _short_backward_programs(monkeypatch):
    monkeypatch.setattr(conv1d_triton, "BWD_TILES_PER_PROGRAM", BWD_TILES)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def packed_xbc(dtype, seed=0):
    """``[b, s, CHANNELS]`` view of channels OFFSET.. of a sequence-major ``[s, b, PACKED]`` buffer."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(SEQ, BATCH, PACKED, generator=g).to(DEVICE, dtype)
    return packed.transpose(0, 1)[..., OFFSET : OFFSET + CHANNELS]


def conv_params(width, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(CHANNELS, 1, width, generator=g) / width**0.5
    bias = torch.randn(CHANNELS, generator=g) * 0.5
    return weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def reference_conv_grads(xBC, weight, bias, grad_out):
    leaves = [t.detach().double().requires_grad_(True) for t in (xBC, weight, bias)]
    out = causal_conv1d_silu(*leaves)
    out.backward(grad_out.double())
    return out.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_forward_and_backward_match_reference_on_packed_views(width):
    xBC = packed_xbc(torch.float32)
    weight, bias = conv_params(width, torch.float32)
    grad_out = torch.randn(BATCH, SEQ, CHANNELS, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want_out, want_dx, want_dw, want_db = reference_conv_grads(xBC, weight, bias, grad_out)

    out = conv_fwd(xBC, weight, bias)
    assert out.shape == xBC.shape and out.stride(0) < out.stride(1), "output keeps the input's sequence-major order"
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)

    grad_packed = torch.full((SEQ, BATCH, PACKED), float("nan"), device=DEVICE)
    grad_view = grad_packed.transpose(0, 1)[..., OFFSET : OFFSET + CHANNELS]
    dx, dw, db = conv_bwd(xBC, weight, bias, grad_out, grad_x=grad_view)
    assert dx.data_ptr() == grad_view.data_ptr()
    torch.testing.assert_close(grad_view.double(), want_dx, rtol=1e-5, atol=1e-5)
    outside = torch.cat([grad_packed[..., :OFFSET], grad_packed[..., OFFSET + CHANNELS :]], dim=-1)
    assert outside.isnan().all(), "the backward wrote outside its channel slice"
    assert dw.shape == weight.shape and db.shape == bias.shape
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(db.double(), want_db, rtol=1e-5, atol=1e-4)


def test_conv_in_bf16_agrees_with_fp64_reference_to_bf16_tolerance():
    xBC = packed_xbc(torch.bfloat16)
    weight, bias = conv_params(4, torch.bfloat16)
    grad_out = torch.randn(BATCH, SEQ, CHANNELS, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    want_out, want_dx, want_dw, want_db = reference_conv_grads(xBC, weight, bias, grad_out)
    out = conv_fwd(xBC, weight, bias)
    dx, dw, db = conv_bwd(xBC, weight, bias, grad_out)
    assert out.dtype == dx.dtype == dw.dtype == db.dtype == torch.bfloat16
    for got, want in ((out, want_out), (dx, want_dx), (dw, want_dw), (db, want_db)):
        assert rel_err(got, want) < 1e-2


def test_conv_rejects_mismatched_weights_and_strided_channels():
    xBC = packed_xbc(torch.float32)
    weight, bias = conv_params(4, torch.float32)
    with pytest.raises(ValueError, match=rf"conv1d weight must be \[{CHANNELS}, 1, width\] and bias \[{CHANNELS}\]"):
        conv_fwd(xBC, weight[:-1], bias)
    with pytest.raises(ValueError, match="conv1d input needs channel stride 1"):
        conv_fwd(xBC.transpose(1, 2).contiguous().transpose(1, 2), weight, bias)
    wide, _ = conv_params(5, torch.float32)
    with pytest.raises(ValueError, match=r"conv1d width \(mamba_d_conv\) must be at most 4, got 5"):
        conv_bwd(xBC, wide, bias, torch.zeros_like(xBC))


NORM_ROWS_S, NORM_ROWS_B = 23, 3
NORM_CHANNELS = 36


def norm_inputs(dtype, seed=0):
    """The fused path's layouts, as ``[s, b, n]`` views: x batch-major (the scan's output), the
    gate cut out of a packed sequence-major buffer, the output gradient contiguous."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NORM_ROWS_B, NORM_ROWS_S, NORM_CHANNELS, generator=g).to(DEVICE, dtype).transpose(0, 1)
    packed = torch.randn(NORM_ROWS_S, NORM_ROWS_B, NORM_CHANNELS + 9, generator=g).to(DEVICE, dtype)
    gate = packed[..., 4 : 4 + NORM_CHANNELS]
    weight = (1 + 0.3 * torch.randn(NORM_CHANNELS, generator=g)).to(DEVICE, dtype)
    grad_out = torch.randn(NORM_ROWS_S, NORM_ROWS_B, NORM_CHANNELS, generator=g).to(DEVICE, dtype)
    return x, gate, weight, grad_out


def reference_norm_grads(x, gate, weight, grad_out, group_size):
    leaves = [t.detach().double().requires_grad_(True) for t in (x, gate, weight)]
    out = gated_rms_norm(*leaves, group_size, EPS)
    out.backward(grad_out.double())
    return out.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("group_size", [12, 36])  # three groups of a non-power-of-two size; one group
def test_gated_norm_forward_and_backward_match_reference_across_layouts(group_size):
    x, gate, weight, grad_out = norm_inputs(torch.float32)
    want_out, want_dx, want_dgate, want_dw = reference_norm_grads(x, gate, weight, grad_out, group_size)
    out = norm_fwd(x, gate, weight, group_size, EPS)
    assert out.is_contiguous()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)

    dx_view = torch.full((NORM_ROWS_B, NORM_ROWS_S, NORM_CHANNELS), float("nan"), device=DEVICE).transpose(0, 1)
    dgate_packed = torch.full((NORM_ROWS_S, NORM_ROWS_B, NORM_CHANNELS + 9), float("nan"), device=DEVICE)
    dgate_view = dgate_packed[..., 4 : 4 + NORM_CHANNELS]
    dx, dgate, dw = norm_bwd(x, gate, weight, grad_out, group_size, EPS, grad_x=dx_view, grad_gate=dgate_view)
    assert dx.data_ptr() == dx_view.data_ptr() and dgate.data_ptr() == dgate_view.data_ptr()
    torch.testing.assert_close(dx_view.double(), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dgate_view.double(), want_dgate, rtol=1e-5, atol=1e-5)
    assert dgate_packed[..., :4].isnan().all() and dgate_packed[..., 4 + NORM_CHANNELS :].isnan().all()
    torch.testing.assert_close(dw.double(), want_dw, rtol=1e-5, atol=1e-4)


def test_gated_norm_in_bf16_agrees_with_fp64_reference_to_bf16_tolerance():
    x, gate, weight, grad_out = norm_inputs(torch.bfloat16, seed=5)
    want = reference_norm_grads(x, gate, weight, grad_out, 12)
    got = (norm_fwd(x, gate, weight, 12, EPS), *norm_bwd(x, gate, weight, grad_out, 12, EPS))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16 and rel_err(g, w) < 1e-2


def test_gated_norm_rejects_groups_that_do_not_split_the_channels():
    x, gate, weight, _ = norm_inputs(torch.float32)
    with pytest.raises(ValueError, match="gated norm: 36 channels do not split into groups of 10"):
        norm_fwd(x, gate, weight, 10, EPS)
    with pytest.raises(ValueError, match=r"gated norm: gate must be \(23, 3, 36\) with channel stride 1"):
        norm_fwd(x, gate[..., :-1], weight, 12, EPS)
