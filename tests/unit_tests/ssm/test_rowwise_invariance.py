"""``mixer_reference.rowwise`` gives each row of an elementwise op the bits it gets in a batch of
any size (torch's CPU loops compute the tail past the last whole vector chunk with scalar code,
which rounds softplus and SiLU differently), and the Mamba decode update built on it
(``ssd_step``, whose read-out is a sum rather than a batched matmul, with the softplus of
``TorchSSMBackend.state_update``) is row invariant."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.backends import TorchSSMBackend
from megatron.core.ssm.mixer_reference import rowwise

HEADS = 8  # a row of 8 values: a batch of b rows has 8 b elements, a tail for most b


def _rows_differ(fn, x: torch.Tensor) -> int:
    """How many row counts ``b < len(x)`` give some row other bits than the whole batch does."""
    whole = fn(x)
    return sum(not torch.equal(fn(x[:b]), whole[:b]) for b in range(1, x.shape[0]))


@pytest.mark.parametrize("op", [F.softplus, F.silu, torch.exp])
def test_rowwise_gives_every_row_its_bits_of_the_whole_batch(op):
    x = torch.randn(48, HEADS, generator=torch.Generator().manual_seed(0)) * 4
    assert _rows_differ(lambda t: rowwise(op, t), x) == 0
    torch.testing.assert_close(rowwise(op, x), op(x), rtol=1e-6, atol=0)  # the same function


def test_plain_softplus_and_silu_round_rows_differently_by_batch_size():
    # The negative control: without rowwise, some row counts change some rows' bits.
    x = torch.randn(48, HEADS, generator=torch.Generator().manual_seed(0)) * 4
    assert _rows_differ(F.softplus, x) > 0 and _rows_differ(F.silu, x) > 0


def test_torch_decode_state_update_is_row_invariant():
    g = torch.Generator().manual_seed(1)
    rows, p, n = 40, 32, 16  # shapes at which a batched matmul computes one row differently
    state = torch.randn(rows, HEADS, p, n, generator=g)
    x, dt = torch.randn(rows, HEADS, p, generator=g), torch.randn(rows, HEADS, generator=g) * 3
    B, C = torch.randn(rows, 2, n, generator=g), torch.randn(rows, 2, n, generator=g)
    A, D, dt_bias = (
        -torch.rand(HEADS, generator=g) * 4,
        torch.randn(HEADS, generator=g),
        torch.randn(HEADS, generator=g),
    )
    whole_state = state.clone()
    whole = TorchSSMBackend.state_update(whole_state, x, dt, A, B, C, D, dt_bias)
    for b in range(1, rows):
        part_state = state[:b].clone()
        part = TorchSSMBackend.state_update(part_state, x[:b], dt[:b], A, B[:b], C[:b], D, dt_bias)
        assert torch.equal(part, whole[:b]) and torch.equal(part_state, whole_state[:b]), b
