"""The chunked SSD scan and the one-token update against a token-by-token hand loop."""

import pytest
import torch

from megatron.core.ssm.ssd_reference import ssd_chunked_scan, ssd_step
from tests.unit_tests.dist_harness import run_distributed


def _inputs(batch=2, seq_len=11, nheads=4, head_dim=3, ngroups=2, d_state=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, nheads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.rand(batch, seq_len, nheads, generator=g, dtype=torch.float64) * 0.5 + 0.05
    A = -torch.rand(nheads, generator=g, dtype=torch.float64) * 2 - 0.1
    B = torch.randn(batch, seq_len, ngroups, d_state, generator=g, dtype=torch.float64)
    C = torch.randn(batch, seq_len, ngroups, d_state, generator=g, dtype=torch.float64)
    D = torch.randn(nheads, generator=g, dtype=torch.float64)
    h0 = torch.randn(batch, nheads, head_dim, d_state, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, D, h0


def _hand_loop(x, dt, A, B, C, D, h0):
    """The recurrence written out per batch row, token, head, channel and state entry
    (scalar tensors in nested lists, so autograd can follow it too)."""
    batch, seq_len, nheads, head_dim = x.shape
    heads_per_group = nheads // B.shape[2]
    d_state = B.shape[3]
    state = [
        [[[h0[b, h, p, n] for n in range(d_state)] for p in range(head_dim)] for h in range(nheads)]
        for b in range(batch)
    ]
    y = [[[[None] * head_dim for _ in range(nheads)] for _ in range(seq_len)] for _ in range(batch)]
    for b in range(batch):
        for t in range(seq_len):
            for h in range(nheads):
                grp = h // heads_per_group
                decay = torch.exp(dt[b, t, h] * A[h])
                for p in range(head_dim):
                    acc = D[h] * x[b, t, h, p]
                    for n in range(d_state):
                        state[b][h][p][n] = decay * state[b][h][p][n] + dt[b, t, h] * x[b, t, h, p] * B[b, t, grp, n]
                        acc = acc + state[b][h][p][n] * C[b, t, grp, n]
                    y[b][t][h][p] = acc

    def stack(nested):
        return torch.stack([stack(i) for i in nested]) if isinstance(nested, list) else nested

    return stack(y), stack(state)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 16])
def test_chunked_scan_matches_hand_loop_with_initial_state(chunk_size):
    x, dt, A, B, C, D, h0 = _inputs()
    want_y, want_state = _hand_loop(x, dt, A, B, C, D, h0)
    y, state = ssd_chunked_scan(
        x.float(), dt.float(), A.float(), B.float(), C.float(), chunk_size, D.float(), h0.float()
    )
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert _rel(y, want_y) < 1e-5
    assert _rel(state, want_state) < 1e-5


def test_chunked_scan_without_initial_state_or_skip_starts_from_zero():
    x, dt, A, B, C, D, h0 = _inputs(seq_len=7)
    want_y, want_state = _hand_loop(x, dt, A, B, C, torch.zeros_like(D), torch.zeros_like(h0))
    y, state = ssd_chunked_scan(x.float(), dt.float(), A.float(), B.float(), C.float(), 3)
    assert _rel(y, want_y) < 1e-5 and _rel(state, want_state) < 1e-5


def test_step_update_continues_the_scan_token_by_token():
    x, dt, A, B, C, D, h0 = _inputs(seq_len=9)
    x, dt, A, B, C, D, h0 = (t.float() for t in (x, dt, A, B, C, D, h0))
    scan_y, scan_state = ssd_chunked_scan(x, dt, A, B, C, 4, D, h0)
    state = h0
    for t in range(x.shape[1]):
        y_t, new_state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        assert _rel(y_t, scan_y[:, t]) < 1e-5
        state = new_state
    assert _rel(state, scan_state) < 1e-5


def test_step_update_leaves_the_given_state_untouched():
    x, dt, A, B, C, D, h0 = (t.float() for t in _inputs(seq_len=1))
    before = h0.clone()
    ssd_step(h0, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    assert torch.equal(h0, before)


def _gradients_vs_hand_loop():
    x, dt, A, B, C, D, h0 = _inputs(batch=1, seq_len=6, nheads=2, head_dim=2, ngroups=1, d_state=3)
    leaves = [t.clone().requires_grad_(True) for t in (x, dt, A, B, C, D, h0)]
    y, state = ssd_chunked_scan(*leaves[:5], 4, leaves[5], leaves[6])
    (y.sum() + state.sum()).backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, dt, A, B, C, D, h0)]
    ry, rstate = _hand_loop(*ref_leaves)
    (ry.sum() + rstate.sum()).backward()
    return [
        (bool(torch.isfinite(got.grad).all()), _rel(got.grad, want.grad))
        for got, want in zip(leaves, ref_leaves, strict=True)
    ]


def test_scan_gradients_are_finite_and_match_the_hand_loop():
    # In a forked rank: a backward pass in the test process would start autograd threads
    # that make later forked multi-rank tests fail on CUDA builds of torch.
    (checks,) = run_distributed(_gradients_vs_hand_loop, 1)
    assert len(checks) == 7
    for finite, rel in checks:
        assert finite and rel < 1e-5


def test_heads_must_divide_into_groups():
    x, dt, A, B, C, D, h0 = (t.float() for t in _inputs(nheads=3, ngroups=2))
    with pytest.raises(ValueError, match=r"number of heads \(3\) must be divisible by number of groups \(2\)"):
        ssd_chunked_scan(x, dt, A, B, C, 4)


@pytest.mark.parametrize("history_elements", [1, 200, 1 << 23])
def test_recurrence_over_calls_gives_the_bits_of_one_token_updates(monkeypatch, history_elements):
    """``ssd_recurrence`` (states of a run kept in one buffer, outputs read after its last call)
    against ``ssd_advance`` call by call, bitwise in fp32: three requests of 5, 3 and 1 tokens run
    as calls of 3, 2 (padded to 3), 2 (one real) rows; a small history budget splits the calls
    into several runs."""
    from megatron.core.ssm import ssd_reference
    from megatron.core.ssm.ssd_reference import ssd_advance, ssd_recurrence, ssd_step_factors

    monkeypatch.setattr(ssd_reference, "HISTORY_ELEMENTS", history_elements)
    active = [3, 2, 2, 1, 1]
    sizes = [3, 3, 2, 2, 2]
    calls, start = [], 0
    for size in sizes:
        calls.append(slice(start, start + size))
        start += size
    x, dt, A, B, C, D, h0 = (t.float() for t in _inputs(batch=1, seq_len=start, seed=3))
    factors = ssd_step_factors(x[0], dt[0], A, B[0], C[0], D)
    state = torch.randn(3, *h0.shape[1:], generator=torch.Generator().manual_seed(4))
    before = state.clone()
    y, final = ssd_recurrence(state, factors, calls, active)
    assert torch.equal(state, before)
    working, want_y, want_final = state.clone(), [], torch.empty_like(state)
    for index, call in enumerate(calls):
        rows = call.stop - call.start
        out, working[:rows] = ssd_advance(working[:rows], factors.rows(call))
        want_y.append(out)
        done = active[index + 1] if index + 1 < len(calls) else 0
        want_final[done : active[index]] = working[done : active[index]]
    assert torch.equal(y, torch.cat(want_y)) and torch.equal(final, want_final)
