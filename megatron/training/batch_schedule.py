"""The global batch size as training goes: Megatron's ``--step-batch-size-schedule`` and its
older ``--rampup-batch-size``. The batch of an iteration depends on the samples consumed before
it, so a resumed run (which restores the consumed-sample count) continues the schedule.

``--step-batch-size-schedule "0:16 2.4B:320 4.8B:624"`` gives a batch size from each threshold
on; thresholds count tokens (samples x ``--seq-length``) and take the suffixes K, M, B and T.
``--rampup-batch-size START INCREMENT SAMPLES`` grows the batch from START by INCREMENT in equal
steps over SAMPLES samples up to ``--global-batch-size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.errors import MegatronConfigError

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class BatchScheduleError(MegatronConfigError):
    """A schedule that cannot be read or run; the message names the entry at fault."""


def _number(text: str) -> int:
    text = text.strip().upper()
    multiplier = SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in SUFFIXES else text
    try:
        return int(float(digits) * multiplier)
    except ValueError:
        raise BatchScheduleError(f"{text!r} is not a number (suffixes: K, M, B, T)") from None


@dataclass(frozen=True)
class BatchSchedule:
    """``steps``: ``(first sample, global batch size)`` pairs, the first at sample 0."""

    steps: tuple[tuple[int, int], ...]

    @classmethod
    def constant(cls, global_batch_size: int) -> BatchSchedule:
        return cls(((0, global_batch_size),))

    @classmethod
    def parse(cls, text: str, seq_length: int) -> BatchSchedule:
        """Megatron's ``THRESHOLD:BATCH ...`` with token thresholds."""
        steps = []
        for entry in text.replace(",", " ").split():
            if ":" not in entry:
                raise BatchScheduleError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE")
            threshold, batch = entry.split(":", 1)
            steps.append((_number(threshold) // seq_length, _number(batch)))
        steps.sort()
        if not steps or steps[0][0] != 0:
            raise BatchScheduleError("the first entry must start at threshold 0")
        if len({start for start, _ in steps}) != len(steps):
            raise BatchScheduleError("two entries start at the same sample")
        if any(batch < 1 for _, batch in steps):
            raise BatchScheduleError("batch sizes must be >= 1")
        return cls(tuple(steps))

    @classmethod
    def rampup(cls, start: int, increment: int, samples: int, final: int) -> BatchSchedule:
        """Megatron's ramp-up: ``(final - start) / increment`` increments, one every
        ``samples / increments`` samples."""
        if start < 1 or increment < 1 or samples < 0 or final < start or (final - start) % increment:
            raise BatchScheduleError(
                f"ramp-up from {start} by {increment} must reach --global-batch-size ({final}) in whole increments"
            )
        increments = (final - start) // increment
        every = samples / increments if increments else 0
        return cls(tuple((round(i * every), start + i * increment) for i in range(increments + 1)))

    @property
    def final(self) -> int:
        return self.steps[-1][1]

    @property
    def is_constant(self) -> bool:
        return len(self.steps) == 1

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration after ``consumed_samples`` samples."""
        return next(batch for start, batch in reversed(self.steps) if consumed_samples >= start)

    def samples(self, iterations: int) -> int:
        """Samples the first ``iterations`` iterations consume."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.batch_size(consumed)
        return consumed

    def iterations(self, samples: int) -> int:
        """Iterations until at least ``samples`` samples are consumed (Megatron's count)."""
        consumed = iterations = 0
        while consumed < samples:
            consumed += self.batch_size(consumed)
            iterations += 1
        return iterations

    def describe(self) -> str:
        return ", ".join(f"{batch} from sample {start}" for start, batch in self.steps)
