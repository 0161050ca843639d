"""The per-row log-softmax equals torch's (``-inf`` logits included) and a row's log-probs are
bitwise the same whatever the number of rows, on both backends; top-k of it is a selection."""

import pytest
import torch

from megatron.core.inference.kernels import log_softmax

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["torch", "triton"]


def logits(rows, vocab, seed=0):
    values = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    values[1, :50] = float("-inf")  # masked vocabulary entries
    return values.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [96, 5000])
def test_log_softmax_matches_torch_and_keeps_minus_inf(backend, vocab):
    x = logits(6, vocab)
    out = log_softmax(x, backend=backend)
    want = torch.log_softmax(x.float(), dim=-1)
    assert out.dtype == torch.float32
    assert torch.equal(torch.isneginf(out), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(out[finite], want[finite], rtol=0, atol=2e-5)
    assert torch.equal(out.topk(5, dim=-1).indices, want.topk(5, dim=-1).indices)


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_probs_of_a_row_do_not_depend_on_the_other_rows(backend):
    x = logits(9, 5000)
    full = log_softmax(x, backend=backend)
    for rows in (slice(0, 1), slice(3, 4), slice(2, 7)):
        assert torch.equal(log_softmax(x[rows], backend=backend), full[rows])


@pytest.mark.gpu(1)
def test_gpu_log_softmax_rows_are_bitwise_the_same_at_every_bucket():
    x = (torch.randn(256, 50304, device="cuda") * 4).bfloat16()
    full = log_softmax(x, backend="triton")
    torch.testing.assert_close(full, torch.log_softmax(x.float(), -1), rtol=0, atol=1e-4)
    for rows in (1, 2, 8, 64, 200):
        assert torch.equal(log_softmax(x[:rows], backend="triton"), full[:rows]), rows
