"""The harness itself: results come back in rank order, a raising rank is named with its
traceback, and a rank stuck in a collective fails the test in bounded time."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_harness import DistributedTestFailure, run_distributed


def _rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_results_come_back_in_rank_order():
    assert run_distributed(_rank_and_sum, 4) == [(0, 10.0), (1, 10.0), (2, 10.0), (3, 10.0)]


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise KeyError("planted failure")
    dist.barrier()


def test_a_raising_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match=r"(?s)rank 1 raised:.*KeyError: 'planted failure'"):
        run_distributed(_rank_one_raises, 2, timeout_s=60)
    assert time.monotonic() - start < 30


def _rank_zero_skips_the_collective():
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def test_a_rank_stuck_in_a_collective_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match="did not finish within 6s|raised"):
        run_distributed(_rank_zero_skips_the_collective, 2, timeout_s=6)
    assert time.monotonic() - start < 20


def test_a_monkeypatch_reaches_every_rank_as_its_own_fixture(monkeypatch):
    # Under torchrun the arguments of rank 0 travel through the store; a pickled copy of a
    # monkeypatch would patch without ever undoing (its fixture is not the copy), leaking the
    # patch into every later test of the process.
    from tests.unit_tests.dist_harness import _arguments_of_rank_zero, _publish_arguments

    store = dist.HashStore()
    _publish_arguments(store, (monkeypatch, 3), {"path": "p"})
    elsewhere = pytest.MonkeyPatch()
    args, kwargs = _arguments_of_rank_zero(store, (elsewhere, 0), {"path": None})
    assert args[0] is elsewhere and args[1] == 3 and kwargs == {"path": "p"}
