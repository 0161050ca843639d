"""RNG tracker streams, model-parallel seeding and activation checkpointing with dropout."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    checkpoint,
    get_rng_tracker,
    init_rng_scope,
    model_parallel_manual_seed,
)
from megatron.core.tensor_parallel.random import RNGTrackerError
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.tensor_parallel.helpers import collection, tp_config


def test_fork_advances_only_its_stream_and_restores_the_default_rng():
    tracker = RNGStatesTracker()
    tracker.add("a", 5)
    torch.manual_seed(1)
    expected_default = torch.rand(4)
    torch.manual_seed(1)
    with tracker.fork("a"):
        first = torch.rand(4)
    with tracker.fork("a"):
        second = torch.rand(4)
    assert torch.equal(torch.rand(4), expected_default)
    torch.manual_seed(5)
    assert torch.equal(first, torch.rand(4)) and torch.equal(second, torch.rand(4))
    with pytest.raises(RNGTrackerError, match="RNG stream 'a' already exists"):
        tracker.add("a", 6)
    with pytest.raises(RNGTrackerError, match=r"RNG stream 'b' was not added; known streams: \['a'\]"):
        with tracker.fork("b"):
            pass


def _seeded_draws():
    pg = collection(tp=2)
    model_parallel_manual_seed(42, pg)
    default = torch.rand(3)
    with get_rng_tracker().fork():
        tp_stream = torch.rand(3)
    return default, tp_stream


def test_model_parallel_seed_shares_default_rng_and_splits_the_tp_stream():
    (d0, t0), (d1, t1) = run_distributed(_seeded_draws, 2)
    assert torch.equal(d0, d1)
    assert not torch.equal(t0, t1)


def block(x, w):
    with get_rng_tracker().fork():
        h = F.dropout(torch.tanh(x @ w), p=0.5, training=True)
    return F.dropout(h @ w, p=0.5, training=True)


def test_checkpoint_recomputes_with_the_forward_rng_and_matches_plain_backward():
    tracker = get_rng_tracker()
    grads = []
    for use_checkpoint in (False, True):
        tracker.reset()
        tracker.add("model-parallel-rng", 11)
        torch.manual_seed(3)
        x = torch.randn(4, 6, requires_grad=True)
        w = torch.randn(6, 6, requires_grad=True)
        out = checkpoint(block, x, w) if use_checkpoint else block(x, w)
        torch.rand(10)  # RNG use between forward and backward must not change the recomputation
        out.sum().backward()
        grads.append((out.detach(), x.grad, w.grad))
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
    assert (grads[0][0] == 0).any()  # dropout really dropped something


def _checkpointed_parallel_block():
    pg = collection(gtp=2)
    config = tp_config()
    with init_rng_scope(config, "layer1"):
        fc1 = ColumnParallelLinear(6, 10, config=config, init_method=torch.nn.init.normal_, pg_collection=pg).to(
            device()
        )
        fc2 = RowParallelLinear(10, 6, config=config, init_method=torch.nn.init.normal_, pg_collection=pg).to(device())

    def mlp(x):
        with get_rng_tracker().fork():
            h = F.dropout(F.gelu(fc1(x)[0]), p=0.3, training=True)
        return fc2(h)[0]

    results = []
    for use_checkpoint in (False, True):
        model_parallel_manual_seed(9, pg)
        x = (
            torch.randn(4, 2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
            .to(device())
            .requires_grad_(True)
        )
        out = checkpoint(mlp, x) if use_checkpoint else mlp(x)
        out.sum().backward()
        results.append([t.detach().clone() for t in (out, x.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad)])
        for module in (fc1, fc2):
            module.zero_grad(set_to_none=True)
    for plain, recomputed in zip(*results, strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=1e-6, atol=1e-6)
    return True


def test_checkpoint_of_a_gtp_sharded_block_matches_plain_backward():
    assert run_distributed(_checkpointed_parallel_block, 2) == [True, True]
