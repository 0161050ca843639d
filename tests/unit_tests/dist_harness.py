"""Run a test function on N real processes (gloo on CPU), or on the torchrun world (GPU buckets).

``run_distributed(fn, world_size, *args)`` forks ``world_size`` ranks that join a
process group through a file store, runs ``fn(*args)`` on each and returns every rank's
result in rank order. Any rank's exception fails the test with that rank's traceback;
a rank that never returns (stuck in a collective) fails it within ``timeout_s``, after its
stack has been dumped, instead of hanging the suite.

Under ``torchrun`` (the GPU bucket runner, tools/run_test_bucket.py) the already-launched
ranks run ``fn`` in place, on NCCL when CUDA is present and gloo otherwise; a test whose world
size differs from torchrun's is skipped as needing that many GPUs. Each call gets a fresh world
(its own process group over a store namespace of its own, destroyed afterwards), so a test that
fails or strands a collective cannot desynchronize the tests after it, and no process group is
left between tests. Every rank runs ``fn`` with rank 0's arguments, as forked ranks all get the
parent's: paths (``tmp_path`` differs per process) and inputs drawn in the test body agree.
Arguments that cannot be pickled (functions defined in the test) stay each rank's own.
Outcomes travel through the store, so every rank raises the same failure, naming each rank.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  - imported once here, not lazily in every forked rank

DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_TEST_TIMEOUT_S", 180))
ERROR_GRACE_S = 5.0


class DistributedTestFailure(AssertionError):
    """One or more ranks raised or hung; the message carries each rank's story."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)


def device() -> torch.device:
    """The device tensors of a distributed test belong on: CUDA under NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cleanup_rank_state():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _wait_for_every_rank(store: dist.Store, key: str, world_size: int, timeout_s: float | None = None) -> None:
    """Store-only barrier. Gloo connects a group's full mesh pair by pair, and a rank that
    exits while a peer is still completing its handshakes (in ``init_process_group`` or a
    ``new_group``) makes that peer fail with "Connection closed by peer"; so ranks meet after
    init and again before they exit (there with a bound: a peer may be stuck or dead)."""
    store.add(key, 1)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while store.add(key, 0) < world_size and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.001)


def _rank_main(rank, world_size, store_path, fn, args, kwargs, results, collective_timeout_s):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    store = None
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        _wait_for_every_rank(store, "initialized", world_size)
        # Plain pickle copies tensors; the multiprocessing pickler would share them by
        # file descriptor, which dies with this process.
        value = pickle.dumps(fn(*args, **kwargs))
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        _cleanup_rank_state()
        results.close()
        results.join_thread()  # flush the queue's feeder thread before the hard exit
        if store is not None:
            _wait_for_every_rank(store, "finished", world_size, timeout_s=ERROR_GRACE_S)
    # Skip interpreter teardown: a rank whose peers died may block in backend destructors.
    os._exit(0)


_torchrun_store: list[dist.Store] = []
_torchrun_calls: dict[str, int] = {}


def _torchrun_base_store() -> dist.Store:
    """The store torchrun's rendezvous offers every rank (created once per process)."""
    if not _torchrun_store:
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S)))
        _torchrun_store.append(store)
    return _torchrun_store[0]


def _call_namespace() -> str:
    """A store namespace that every rank derives alike for this call: the pytest item and phase,
    and how many harness calls it made before (ranks that disagree on the test never meet)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "outside-pytest")
    count = _torchrun_calls.get(test, 0)
    _torchrun_calls[test] = count + 1
    return f"megatron-test/{test}/{count}/"


def _publish_arguments(store: dist.Store, args, kwargs) -> None:
    """Rank 0: put its arguments in the store; one it cannot pickle is marked local, and so is
    a ``monkeypatch`` (a copy's patches would outlive the test: only each rank's own fixture
    undoes them at teardown)."""
    blobs = []
    for item in [*args, *kwargs.values()]:
        if isinstance(item, pytest.MonkeyPatch):
            blobs.append(None)
            continue
        try:
            blobs.append(pickle.dumps(item))
        except Exception:  # noqa: BLE001 - a lambda or local function: every rank has its own
            blobs.append(None)
    store.set("arguments", pickle.dumps(blobs))


def _arguments_of_rank_zero(store: dist.Store, args, kwargs):
    items = [*args, *kwargs.values()]
    blobs = pickle.loads(store.get("arguments"))
    values = [item if blob is None else pickle.loads(blob) for item, blob in zip(items, blobs, strict=True)]
    return values[: len(args)], dict(zip(kwargs, values[len(args) :], strict=True))


def _exchange_outcomes(store, rank, world_size, outcome, deadline) -> dict[int, tuple[bool, object]]:
    try:
        blob = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - an unpicklable result is this rank's failure
        blob = pickle.dumps((False, f"the result could not be pickled:\n{traceback.format_exc()}"))
    store.set(f"outcome/{rank}", blob)
    outcomes = {}
    while len(outcomes) < world_size:
        for peer in range(world_size):
            if peer not in outcomes and store.check([f"outcome/{peer}"]):
                outcomes[peer] = pickle.loads(store.get(f"outcome/{peer}"))
        if len(outcomes) < world_size:
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
    return outcomes


def _run_in_torchrun_world(fn, world_size, args, kwargs, timeout_s):
    torchrun_world = int(os.environ["WORLD_SIZE"])
    if torchrun_world != world_size:
        pytest.skip(f"needs {world_size} GPUs (torchrun world has {torchrun_world})")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this rank; run_distributed makes its own")
    rank = int(os.environ["RANK"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    store = dist.PrefixStore(_call_namespace(), _torchrun_base_store())
    if rank == 0:
        _publish_arguments(store, args, kwargs)
    # A peer may still be finishing a previous test that stranded it in a collective.
    _wait_for_every_rank(store, "arrived", world_size, timeout_s=DEFAULT_TIMEOUT_S + 2 * ERROR_GRACE_S)
    if store.add("arrived", 0) < world_size:
        pytest.fail(f"not every rank of the torchrun world reached this test within {DEFAULT_TIMEOUT_S:g}s")
    if rank != 0:  # rank 0 runs on its own objects
        args, kwargs = _arguments_of_rank_zero(store, args, kwargs)
    start = time.monotonic()
    try:
        try:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
            )
            _wait_for_every_rank(store, "initialized", world_size, timeout_s=timeout_s)
            faulthandler.dump_traceback_later(timeout_s)  # a rank stuck in a collective shows where
            outcome = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - every failure must reach every rank
            outcome = (False, traceback.format_exc())
        finally:
            faulthandler.cancel_dump_traceback_later()
        outcomes = _exchange_outcomes(store, rank, world_size, outcome, start + timeout_s + ERROR_GRACE_S)
    finally:
        if dist.is_initialized():
            _cleanup_rank_state()
            dist.destroy_process_group()
    _raise_for_failures(fn, world_size, timeout_s, outcomes)
    return [outcomes[r][1] for r in range(world_size)]


def _raise_for_failures(fn, world_size, timeout_s, outcomes) -> None:
    stuck = [r for r in range(world_size) if r not in outcomes]
    failures = [f"rank {r} raised:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    failures += [f"rank {r} did not finish within {timeout_s:g}s (stuck in a collective?)" for r in stuck]
    if failures:
        causes = [f"rank {r}: {v.strip().splitlines()[-1][:160]}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        causes += [f"rank {r}: stuck" for r in stuck]
        raise DistributedTestFailure(
            f"{fn.__name__} on {world_size} ranks failed ({'; '.join(causes)}):\n" + "\n".join(failures)
        )


def run_distributed(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    Raises DistributedTestFailure naming each failing rank with its traceback, and each
    rank still running after ``timeout_s`` (its stack is dumped to stderr first). After the
    first failure the remaining ranks get a few seconds before they are killed, since they
    are usually waiting on the failed one.
    """
    if under_torchrun():
        return _run_in_torchrun_world(fn, world_size, args, kwargs, timeout_s)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="mtest_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, store_path, fn, args, kwargs, results, timeout_s),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcomes: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode not in (None, 0)]
                for r in dead:
                    outcomes[r] = (False, f"process exited with code {procs[r].exitcode} before reporting")
                continue
            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
            if not ok:
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        stuck = [r for r in range(world_size) if r not in outcomes]
        for r in stuck:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGUSR1)
        if stuck:
            time.sleep(0.5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    _raise_for_failures(fn, world_size, timeout_s, outcomes)
    return [outcomes[r][1] for r in range(world_size)]
