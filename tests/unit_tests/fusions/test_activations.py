"""The fused MLP activations (GELU erf/tanh, SiLU; with fc1's bias; gated over packed
[gate | up]) against the torch reference; the torch path's one-buffer backward is bitwise
the reference's; other activations take the plain ops."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import gelu_tanh, squared_relu
from megatron.core.fusions import activation, fusion_backend
from megatron.core.fusions.activations import activation_reference
from tests.unit_tests.fusions.kernels import DEVICE, assert_bitwise_equal, assert_triton_matches_torch, leaf

FUNCS = (F.gelu, gelu_tanh, F.silu)


def _inputs(gated, with_bias, dtype, n=45, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * n if gated else n
    x = leaf(7, 3, width, dtype=dtype, generator=gen, scale=2.0)
    return [x, leaf(width, dtype=dtype, generator=gen) if with_bias else None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("func", FUNCS, ids=lambda f: f.__name__)
def test_fused_activation_matches_reference(func, gated, dtype):
    inputs = _inputs(gated, with_bias=func is not F.silu, dtype=dtype)
    assert_triton_matches_torch(lambda x, b: activation(x, b, func, gated), inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("func", FUNCS, ids=lambda f: f.__name__)
def test_gated_torch_path_is_bitwise_the_reference(func, dtype):
    inputs = _inputs(gated=True, with_bias=True, dtype=dtype)
    assert_bitwise_equal(
        lambda x, b: activation(x, b, func, True), lambda x, b: activation_reference(x, b, func, True), inputs
    )


def test_unfused_activation_takes_the_plain_ops_on_every_backend():
    x, bias = _inputs(gated=False, with_bias=True, dtype=torch.float32)
    with fusion_backend("triton"):
        out = activation(x, bias, squared_relu, False)
    assert torch.equal(out, squared_relu(x + bias))


def test_forward_only_gated_call_builds_no_graph():
    x, _ = _inputs(gated=True, with_bias=False, dtype=torch.float32)
    for backend in ("torch", "triton"):
        with fusion_backend(backend), torch.no_grad():
            out = activation(x, None, F.silu, True)
        assert out.grad_fn is None and out.device.type == DEVICE.type
        torch.testing.assert_close(out, activation_reference(x, None, F.silu, True).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
def test_backward_programs_walk_several_row_tiles_and_sum_the_bias_over_splits(gated):
    # 70 rows over the interpreter's 4 programs: 24 rows (3 tiles of 8) a split, the last short.
    from megatron.core.fusions.activations_triton import backward_grid

    assert backward_grid(70, 45, 4) == ((1, 3), 24)
    gen = torch.Generator().manual_seed(1)
    x = leaf(70, 2 * 45 if gated else 45, dtype=torch.bfloat16, generator=gen, scale=2.0)
    bias = leaf(x.shape[-1], dtype=torch.bfloat16, generator=gen)
    assert_triton_matches_torch(lambda x, b: activation(x, b, F.gelu, gated), [x, bias], torch.bfloat16)
