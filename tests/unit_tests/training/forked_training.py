"""Training runs in forked processes that a test may kill at a named point of a checkpoint save.

``train(flags, world_size, tmp_path, kill=...)`` forks ``world_size`` gloo ranks (a world of
their own, also under torchrun), runs the real pretraining loop on each and returns their exit
codes; a :class:`Kill` makes one rank SIGKILL itself when it reaches a phase of
``SAVE_PHASES`` for a given iteration, and ``on_rank`` runs a function in each rank first (to
install other hooks). Ranks write to the test's stdout/stderr (read them with ``capfd``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import set_phase_hook
from megatron.core.parallel_state import destroy_distributed
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

# A tiny GPT; format_v1_training (tests/unit_tests/dist_checkpointing/data) was saved with these. No
# evaluation at the end (it follows the last save, so the checkpoints are the same with or without).
FLAGS = [
    *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8"),
    *("--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data", "--vocab-size", "32"),
    *("--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-iters", "20", "--hidden-dropout", "0.1"),
    *("--distributed-backend", "gloo", "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0"),
]
COLLECTIVE_TIMEOUT_S = 30


@dataclass(frozen=True)
class Kill:
    """SIGKILL rank ``rank`` when it reaches ``phase`` while saving ``iteration``."""

    phase: str
    iteration: int
    rank: int = 0

    def __call__(self, phase: str, path: str) -> None:
        if phase == self.phase and f"iter_{self.iteration:07d}" in path:
            os.kill(os.getpid(), signal.SIGKILL)


def _rank_main(rank, world_size, store_path, flags, kill, on_rank):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # Warnings reach stderr as they do outside pytest (whose log capture would swallow them here).
    logging.getLogger("megatron").addHandler(logging.StreamHandler(sys.stderr))
    code = 1
    try:
        store = dist.FileStore(store_path, world_size)
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        if kill is not None and kill.rank == rank:
            set_phase_hook(kill)
        if on_rank is not None:
            on_rank()
        pretrain(parse_args(FLAGS + [str(f) for f in flags], model_family="gpt", world_size=world_size))
        destroy_distributed(timeout_s=COLLECTIVE_TIMEOUT_S)
        code = 0
    except BaseException:  # noqa: BLE001 - the exit code and the traceback on stderr are the report
        traceback.print_exc()
    finally:
        os._exit(code)


def train(flags, world_size: int, tmp_path, kill: Kill | None = None, on_rank=None, timeout_s: float = 120) -> list:
    """Run pretraining with ``flags`` on ``world_size`` forked ranks; their exit codes."""
    store_path = str(tmp_path / f"store-{uuid.uuid4().hex}")
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, store_path, flags, kill, on_rank))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in stuck:
        procs[rank].kill()
        procs[rank].join()
    if stuck:
        raise AssertionError(f"training ranks {stuck} did not finish within {timeout_s:g}s")
    return [proc.exitcode for proc in procs]
