"""Checkpoint saves that run in the background while training continues (``--async-save``).

The training thread takes a snapshot of what a save writes (:class:`SnapshotArena`: a copy in
host memory, pinned for CUDA tensors, reused from one save to the next) and hands the rest of
the save to :class:`AsyncSaver`'s worker thread: validation, writing, publishing and moving the
tracker, in that order. The worker's collectives run over a gloo group of its own, which the
training thread never uses, so they cannot interleave with the training's collectives.

Rules:

* at most one save is in flight: a new save first waits for the previous one to complete;
* the tracker moves only once the save is complete and published (the worker does it last);
* the writer never competes with training for a core: its thread (and the I/O threads it
  starts, which inherit this) runs at the lowest CPU priority (``nice`` 19: the scheduler gives
  a busy training thread its core first) and, with ``writer_cpus``, only on those CPUs;
* the training loop calls :meth:`AsyncSaver.poll` at every iteration. While a save is in
  flight every rank joins one small all-reduce (on a second gloo group) saying whether its
  part has finished; once every rank's has, all of them learn the outcome at the same
  iteration. A failed save (the worker raised on any rank) raises CheckpointIOError there,
  naming the iteration and the cause, and training stops: the tracker still names the last
  complete checkpoint, whose files the failed save never touched.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import dist_utils
from megatron.core.dist_checkpointing.errors import CheckpointIOError

logger = logging.getLogger(__name__)

_ALIGN = 64
WRITER_NICE = 19


def yield_cpu_to_training(nice: int = WRITER_NICE, cpus: Collection[int] | None = None) -> None:
    """Lower the calling thread's CPU priority to ``nice`` and, given ``cpus``, keep it on them
    (threads it starts later inherit both; Linux: both are per thread). Where the system does
    not allow it, the thread keeps its priority and a warning says so."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        if cpus is not None:
            os.sched_setaffinity(tid, set(cpus))
    except (AttributeError, OSError) as exc:  # not Linux, or a sandbox forbids it
        logger.warning("the checkpoint writer thread keeps its CPU priority and placement: %s", exc)


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class SnapshotArena:
    """Host memory that holds one save's copy of its tensors, kept for the next save."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous copies of ``tensors`` in the arena (valid until the next call); CUDA
        tensors are copied into pinned memory, and the copies are complete on return."""
        sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
        pinned = any(t.is_cuda for t in tensors)
        buffer = self._buffer
        if buffer is None or buffer.numel() < sum(sizes) or (pinned and not buffer.is_pinned()):
            self._buffer = buffer = None  # free the old arena before allocating the new one
            buffer = self._buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pinned)
        copies, offset = [], 0
        for tensor, size in zip(tensors, sizes, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            copy = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor, non_blocking=tensor.is_cuda)
            copies.append(copy)
            offset += size
        if pinned:
            torch.cuda.synchronize()
        return copies


class AsyncSaver:
    """Runs one checkpoint save at a time in a background thread (see the module docstring).

    Create it on every rank of ``process_group`` (default: the world), in the same order
    relative to other group creations: it makes two gloo groups over those ranks. The writer
    runs at ``writer_nice`` and, given ``writer_cpus``, only on those CPUs
    (:func:`yield_cpu_to_training`).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        writer_nice: int = WRITER_NICE,
        writer_cpus: Collection[int] | None = None,
    ):
        self.arena = SnapshotArena()
        self._worker_group = self._poll_group = None
        if dist_utils.is_distributed():
            ranks = dist_utils.group_ranks(process_group)
            self._worker_group = dist.new_group(ranks, backend="gloo")
            self._poll_group = dist.new_group(ranks, backend="gloo")
        self._thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="ckpt-save",
            initializer=yield_cpu_to_training,
            initargs=(writer_nice, writer_cpus),
        )
        self._in_flight: tuple[Future, str, Callable[[], None] | None] | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def submit(self, job: Callable[[dist.ProcessGroup | None], None], what: str, on_done=None) -> None:
        """Run ``job(group)`` in the background (``group``: the worker's own); ``what`` names
        the save in errors; ``on_done()`` runs on this thread once every rank's job succeeded.
        Waits for the save in flight first."""
        self.wait()
        self._in_flight = (self._thread.submit(job, self._worker_group), what, on_done)

    def poll(self) -> None:
        """Settle the save in flight if every rank's part has finished (collective while one
        is in flight); raises CheckpointIOError on every rank if it failed on any."""
        if self._in_flight is None:
            return
        if self._agree(float(not self._in_flight[0].done())) == 0:
            self._settle()

    def wait(self) -> None:
        """Block until the save in flight is complete (collective); raises as :meth:`poll`."""
        if self._in_flight is not None:
            self._in_flight[0].exception()  # wait without raising
            self._settle()

    def close(self) -> None:
        """Wait for the save in flight, then stop the worker thread."""
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)

    def _agree(self, value: float) -> float:
        """The sum of ``value`` over the ranks (over the poll group)."""
        if self._poll_group is None:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self._poll_group)
        return total.item()

    def _settle(self) -> None:
        future, what, on_done = self._in_flight
        self._in_flight = None
        error = future.exception()
        failed_ranks = self._agree(float(error is not None))
        if error is not None:
            raise CheckpointIOError(
                f"the asynchronous save of {what} failed: {type(error).__name__}: {error}; the tracker still names "
                "the last complete checkpoint"
            ) from error
        if failed_ranks:
            raise CheckpointIOError(
                f"the asynchronous save of {what} failed on {int(failed_ranks)} other rank(s); the tracker still "
                "names the last complete checkpoint"
            )
        if on_done is not None:
            on_done()
