"""What one rank did during a pipeline schedule: its compute intervals, and the idle time between.

A schedule given a :class:`PipelineTimeline` opens it (``begin``) after a barrier over the
pipeline group, records every micro-batch forward and backward as a compute interval, and
closes it (``end``) after another barrier, so every rank of the pipeline measures the same span
and the pipeline bubble (time spent waiting on the neighbours) is what is not compute. The
idle fraction is read from those intervals, never from a formula; for ``p`` stages, ``v``
virtual stages and ``m`` micro-batches of equal cost it approaches ``(p - 1) / (v m + p - 1)``.
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
    start_s: float | None = None
    end_s: float | None = None

    def begin(self) -> None:
        self.compute.clear()
        self.start_s, self.end_s = time.perf_counter(), None

    def end(self) -> None:
        self.end_s = time.perf_counter()

    def record(self, kind: str, chunk: int, microbatch: int, start_s: float, end_s: float) -> None:
        self.compute.append(ComputeInterval(kind, chunk, microbatch, start_s, end_s))

    def _span(self) -> tuple[float, float]:
        if self.start_s is None or self.end_s is None:
            raise MegatronRuntimeError("the timeline has no complete run: pass it to a schedule first")
        return self.start_s, self.end_s

    @property
    def total_s(self) -> float:
        start, end = self._span()
        return end - start

    @property
    def compute_s(self) -> float:
        return sum(interval.end_s - interval.start_s for interval in self.compute)

    def idle_intervals(self) -> list[tuple[float, float]]:
        """The gaps (start, end) of the span not covered by a compute interval."""
        start, end = self._span()
        gaps, cursor = [], start
        for interval in sorted(self.compute, key=lambda i: i.start_s):
            if interval.start_s > cursor:
                gaps.append((cursor, interval.start_s))
            cursor = max(cursor, interval.end_s)
        if end > cursor:
            gaps.append((cursor, end))
        return gaps

    @property
    def idle_s(self) -> float:
        return sum(gap_end - gap_start for gap_start, gap_end in self.idle_intervals())

    @property
    def idle_fraction(self) -> float:
        """Share of the span this rank spent not computing (waiting on its neighbours)."""
        total = self.total_s
        return self.idle_s / total if total > 0 else 0.0
