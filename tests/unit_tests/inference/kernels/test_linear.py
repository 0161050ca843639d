"""The batch-invariant linear equals ``F.linear`` to rounding, and a row's result is bitwise the
same in batches of any size and at any position in them, on the torch path (CPU) and on the
Triton GEMM (Triton's interpreter without a GPU, compiled on CUDA). The engine's forward runs
the model's linears through it."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.fusions import fusion_backend
from megatron.core.inference.kernels import (
    BACKEND_ENV,
    KernelBackendError,
    batch_invariant,
    invariant_linear,
    is_batch_invariant,
    kernel_backend,
    linear,
)
from megatron.core.inference.kernels.matmul_triton import tile_config
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.init_methods import init_method
from tests.unit_tests.transformer.single_rank import on_single_rank

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["torch", "triton"] if DEVICE.type == "cpu" else ["triton"]


def operands(rows, n, k, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    return tuple(t.to(DEVICE, dtype) for t in (x, w, b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n, k", [(40, 72), (520, 40)])
def test_invariant_linear_matches_f_linear(backend, n, k):
    x, w, b = operands(37, n, k)
    torch.testing.assert_close(invariant_linear(x, w, b, backend=backend), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = x.reshape(37, 1, k)  # [s, b, h] activations keep their leading shape
    assert invariant_linear(x3, w, backend=backend).shape == (37, 1, n)


def test_triton_linear_keeps_bf16_and_agrees_to_its_rounding():
    x, w, _ = operands(21, 40, 72, dtype=torch.bfloat16)
    out = invariant_linear(x, w, backend="triton")
    assert out.dtype == torch.bfloat16
    want = x.float() @ w.float().t()
    torch.testing.assert_close(out.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
# 520: the column tile widens with the row count; K 600: five K slices, on programs of their own
# up to 6 rows and summed in one program beyond
@pytest.mark.parametrize("n, k", [(40, 72), (520, 72), (40, 600)])
def test_rows_are_bitwise_the_same_whatever_the_batch(backend, n, k):
    x, w, b = operands(70, n, k)
    full = invariant_linear(x, w, b, backend=backend)
    for rows in (1, 7, 16, 33):
        assert torch.equal(invariant_linear(x[:rows], w, b, backend=backend), full[:rows]), rows
    shifted = torch.roll(x, 19, dims=0)  # every row at another position of its tile
    assert torch.equal(invariant_linear(shifted, w, b, backend=backend), torch.roll(full, 19, dims=0))
    assert torch.equal(invariant_linear(x[45:46], w, b, backend=backend)[0], full[45])


def _tiles_by_hand(x, w, b):
    padded = torch.cat([x, x.new_zeros(-len(x) % linear.ROW_TILE, x.shape[1])])
    out = torch.cat([padded[i : i + linear.ROW_TILE] @ w.t() for i in range(0, len(padded), linear.ROW_TILE)])
    return out[: len(x)] + b


@pytest.mark.parametrize("whole_call_differs", [False, True])
def test_torch_path_gives_the_bits_of_row_tiles_whether_or_not_one_call_has_them(monkeypatch, whole_call_differs):
    """One GEMM over the padded rows is used only where a probe found it gives the tiles' bits; a
    BLAS whose long GEMM rounds differently (simulated) gets the tiles. (The torch path is the
    CPU one: CPU tensors on a GPU machine too.)"""
    monkeypatch.setattr(linear, "_WHOLE_CALL_MATCHES", {})
    x, w, b = (t.cpu() for t in operands(70, 40, 72))
    want = _tiles_by_hand(x, w, b)
    if whole_call_differs:
        matmul = torch.matmul

        def long_calls_round_differently(a, m, out=None):
            result = matmul(a, m, out=out)
            return result.add_(1e-3) if a.shape[0] > linear.ROW_TILE else result

        monkeypatch.setattr(torch, "matmul", long_calls_round_differently)
    assert torch.equal(linear.torch_invariant_linear(x, w, b), want)
    if whole_call_differs:  # (whether a real BLAS matches is the machine's business)
        assert list(linear._WHOLE_CALL_MATCHES.values()) == [False]


def test_torch_path_multiplies_row_by_row_where_blas_rounds_a_row_by_its_tile_position(monkeypatch):
    """A BLAS that rounds odd rows of a tile differently (simulated; MKL on AVX2 does for some
    weight shapes) is found by the probe, and each row then gets its own call: its bits equal the
    row's own whatever the batch."""
    monkeypatch.setattr(linear, "_POSITION_FREE", {})
    x, w, b = (t.cpu() for t in operands(70, 40, 72))
    matmul = torch.matmul

    def odd_rows_round_differently(a, m, out=None):
        result = matmul(a, m, out=out)
        result[1::2] += 1e-3
        return result

    monkeypatch.setattr(torch, "matmul", odd_rows_round_differently)
    alone = torch.cat([matmul(x[i : i + 1], w.t()) for i in range(len(x))]) + b
    assert torch.equal(linear.torch_invariant_linear(x, w, b), alone)
    assert torch.equal(linear.torch_invariant_linear(x[5:6], w, b), alone[5:6])
    assert list(linear._POSITION_FREE.values()) == [False]


def test_k_step_and_slices_are_functions_of_the_weight_and_the_column_tile_widens_with_rows():
    assert {tile_config(2048, 5504, m, 2, 132).block_k for m in (1, 64, 65, 256)} == {128}
    assert tile_config(2048, 5504, 1, 4, 132).block_k == 64  # fp32
    # 2048 columns on 132 SMs: one row tile wants 16-wide tiles (128 programs), four want 64.
    assert [tile_config(2048, 2048, m, 2, 132).block_n for m in (1, 64, 128, 256)] == [16, 16, 32, 64]
    assert tile_config(50304, 2048, 1, 2, 132).block_n == 128
    assert tile_config(520, 72, 1, 4, 8).block_n == 64 and tile_config(520, 72, 70, 4, 8).block_n == 128
    # A down projection (K >= 2N): 43 K tiles in 8 slices of 6, whatever the rows; on programs of
    # their own (64-wide column tiles, 32 x 8 programs) up to 64 rows, summed in one program beyond.
    down = [tile_config(2048, 5504, m, 2, 132) for m in (1, 8, 64, 65, 1023)]
    assert {config.slice_tiles for config in down} == {6}
    assert [config.split for config in down] == [True, True, True, False, False]
    assert down[0].block_n == 64
    # Square and wide weights keep one slice (all 16 K tiles): a single chain of products.
    assert {tile_config(n, 2048, m, 2, 132).slice_tiles for n in (2048, 6144, 50304) for m in (1, 1023)} == {16}
    # Long 16-bit prefill steps: 128-row tiles with 64-deep K steps, the same slices in K elements.
    long = [tile_config(n, k, 2048, 2, 132) for n, k in ((6144, 2048), (2048, 5504))]
    assert [(c.block_m, c.block_k, c.num_warps) for c in long] == [(128, 64, 8)] * 2
    assert [c.slice_tiles * c.block_k for c in long] == [2048, 6 * 128]
    assert tile_config(6144, 2048, 1023, 2, 132).block_m == 64 and tile_config(6144, 2048, 2048, 4, 132).block_m == 64


@on_single_rank
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_model_linears_are_batch_invariant_inside_the_mode_only(pg, monkeypatch, kernels):
    """``kernels="triton"``: every kernel on Triton (as on a GPU), the fused ops too, so the
    linear adds its bias in the GEMM's epilogue, and that GEMM must be the invariant one."""
    monkeypatch.setenv(BACKEND_ENV, kernels)
    config = TransformerConfig(num_layers=1, hidden_size=72, num_attention_heads=2, add_bias_linear=True)
    layer = ColumnParallelLinear(72, 40, config=config, init_method=init_method(config), pg_collection=pg).to(DEVICE)
    x = torch.randn(50, 1, 72, generator=torch.Generator().manual_seed(1)).to(next(layer.parameters()).device)
    assert not is_batch_invariant()
    with torch.no_grad(), fusion_backend(kernels), batch_invariant():
        assert is_batch_invariant()
        full, _ = layer(x)
        assert torch.equal(layer(x[:3])[0], full[:3]) and torch.equal(layer(x[20:21])[0], full[20:21])
        assert torch.equal(full, invariant_linear(x, layer.weight, layer.bias))
        with batch_invariant(False):
            assert not is_batch_invariant()
        assert is_batch_invariant()
    assert not is_batch_invariant()


def test_backend_resolution_argument_then_environment_then_device(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert kernel_backend(torch.device("cpu")) == "torch"
    assert kernel_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert kernel_backend(torch.device("cuda")) == "torch"
    assert kernel_backend(torch.device("cuda"), "triton") == "triton"
    monkeypatch.setenv(BACKEND_ENV, "cublas")
    with pytest.raises(KernelBackendError, match=r"backend 'cublas' is unknown; accepted: auto, torch, triton"):
        kernel_backend(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelBackendError, match=r"'triton' needs CUDA tensors \(got cpu\)"):
        kernel_backend(torch.device("cpu"), "triton")


@pytest.mark.gpu(1)
@pytest.mark.parametrize("n, k", [(6144, 2048), (2048, 2048), (11008, 2048), (2048, 5504), (50304, 2048)])
def test_gpu_gemm_rows_are_bitwise_the_same_at_every_bucket_and_match_cublas(n, k):
    """The 1.4B model's shapes in bf16: each bucket's rows equal the 2048-row batch's bitwise
    (decode tiles and the long-prefill tiles alike), and the GEMM agrees with cuBLAS to bf16
    rounding."""
    x, w, _ = operands(2048, n, k, dtype=torch.bfloat16)
    full = invariant_linear(x, w)
    for rows in (1, 2, 3, 4, 8, 16, 31, 32, 64, 128, 200, 256, 512, 1023, 1024, 1500):
        assert torch.equal(invariant_linear(x[:rows], w), full[:rows]), rows
    assert torch.equal(invariant_linear(torch.roll(x, 77, 0), w), torch.roll(full, 77, 0))
    want = x.float() @ w.float().t()
    torch.testing.assert_close(full.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
