"""What one rank did during a pipeline schedule: its compute and idle intervals.

A schedule given a :class:`PipelineTimeline` opens it (``begin``) after a barrier over the
pipeline group, records every micro-batch forward and backward as a compute interval and every
wait on a neighbour (a receive, a send's completion, the closing barrier that the stages which
finish first wait in) as an idle interval, and closes it (``end``). The idle fraction is read
from those intervals, never from a formula: ``idle / (idle + compute)``, so the schedule's own
bookkeeping (neither) does not count; for ``p`` stages, ``v`` virtual stages and ``m``
micro-batches of equal cost it approaches ``(p - 1) / (v m + p - 1)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megatron.core.errors import MegatronRuntimeError


@dataclass(frozen=True)
class ComputeInterval:
    """One forward (``kind == "forward"``) or backward pass of micro-batch ``microbatch`` on
    model chunk ``chunk``, from ``start_s`` to ``end_s`` (``time.perf_counter`` seconds)."""

    kind: str
    chunk: int
    microbatch: int
    start_s: float
    end_s: float


@dataclass
class PipelineTimeline:
    """Per-rank compute and idle intervals of one schedule run (see the module docstring)."""

    compute: list[ComputeInterval] = field(default_factory=list)
    idle: list[tuple[float, float]] = field(default_factory=list)
    start_s: float | None = None
    end_s: float | None = None

    def begin(self) -> None:
        self.compute.clear()
        self.idle.clear()
        self.start_s, self.end_s = time.perf_counter(), None

    def end(self) -> None:
        self.end_s = time.perf_counter()

    def record(self, kind: str, chunk: int, microbatch: int, start_s: float, end_s: float) -> None:
        self.compute.append(ComputeInterval(kind, chunk, microbatch, start_s, end_s))

    def record_idle(self, start_s: float, end_s: float) -> None:
        self.idle.append((start_s, end_s))

    def _check_complete(self) -> None:
        if self.start_s is None or self.end_s is None:
            raise MegatronRuntimeError("the timeline has no complete run: pass it to a schedule first")

    @property
    def total_s(self) -> float:
        """The whole span, from the opening barrier to the end."""
        self._check_complete()
        return self.end_s - self.start_s

    @property
    def compute_s(self) -> float:
        self._check_complete()
        return sum(interval.end_s - interval.start_s for interval in self.compute)

    @property
    def idle_s(self) -> float:
        self._check_complete()
        return sum(end - start for start, end in self.idle)

    @property
    def idle_fraction(self) -> float:
        """Share of this rank's compute-or-wait time spent waiting on its neighbours."""
        busy = self.compute_s + self.idle_s
        return self.idle_s / busy if busy > 0 else 0.0


class WaitTimer:
    """Records the calls it makes as idle intervals of ``timeline`` (no-op without one)."""

    def __init__(self, timeline: PipelineTimeline | None):
        self.timeline = timeline

    def __call__(self, fn, *args):
        if self.timeline is None:
            return fn(*args)
        start = time.perf_counter()
        result = fn(*args)
        self.timeline.record_idle(start, time.perf_counter())
        return result
