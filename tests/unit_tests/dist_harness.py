"""Run a test function on N real processes (gloo on CPU), or on the torchrun world (GPU buckets).

``run_distributed(fn, world_size, *args)`` forks ``world_size`` ranks that join a
process group through a file store, runs ``fn(*args)`` on each and returns every rank's
result in rank order. Any rank's exception fails the test with that rank's traceback;
a rank that never returns (stuck in a collective) fails it within ``timeout_s``, after its
stack has been dumped, instead of hanging the suite.

Under ``torchrun`` (the GPU bucket runner) the already-launched ranks run ``fn`` in place
on NCCL when CUDA is present; a test whose world size differs from torchrun's is skipped.
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


def _run_in_torchrun_world(fn, world_size, args, kwargs):
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    if dist.get_world_size() != world_size:
        pytest.skip(f"needs {world_size} GPUs (torchrun world has {dist.get_world_size()})")
    try:
        value = fn(*args, **kwargs)
    finally:
        _cleanup_rank_state()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def run_distributed(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    Raises DistributedTestFailure naming each failing rank with its traceback, and each
    rank still running after ``timeout_s`` (its stack is dumped to stderr first). After the
    first failure the remaining ranks get a few seconds before they are killed, since they
    are usually waiting on the failed one.
    """
    if under_torchrun():
        return _run_in_torchrun_world(fn, world_size, args, kwargs)
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
    failures = [f"rank {r} raised:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    failures += [f"rank {r} did not finish within {timeout_s:g}s (stuck in a collective?)" for r in stuck]
    if failures:
        raise DistributedTestFailure(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(failures))
    return [outcomes[r][1] for r in range(world_size)]
