"""``destroy_distributed`` frees every gloo backend before the process exits.

A backend left to interpreter finalization (held by a module cache or a reference cycle) keeps
its transport and worker threads running while the peers exit, and a rank can then abort with
"terminate called without an active exception" after its work is done. Two forked ranks build
the layout the README's hybrid command uses, run a collective on each group, leave, and report
the gloo threads still alive.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core import parallel_state

GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
FAILED = 100


def _gloo_threads() -> list[str]:
    names = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return [name for name in names if name in GLOO_THREADS]


def _use_groups() -> None:
    """Build the layout and run a collective on each of its groups (references die on return,
    as they do when ``pretrain`` returns)."""
    pg_collection = parallel_state.initialize_model_parallel(generalized_tensor_parallel_size=2)
    for group in (pg_collection.gtp, pg_collection.dp, pg_collection.tp):
        dist.all_reduce(torch.ones(1), group=group)


def _rank_main(rank: int, store_path: str) -> None:
    code = FAILED
    try:
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
        _use_groups()
        parallel_state.destroy_distributed(timeout_s=30)
        code = len(_gloo_threads())
    except BaseException:  # noqa: BLE001 - the exit code and the traceback on stderr are the report
        traceback.print_exc()
    finally:
        os._exit(code)


def test_destroy_distributed_leaves_no_gloo_threads(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(rank, str(tmp_path / "store"))) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0], "exit codes: gloo threads left (100: the rank failed)"
