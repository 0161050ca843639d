"""Incremental stop-sequence detection on detokenized text.

Generation stops at the first stop sequence to *complete* in the text (the earliest end; of
several ending at the same place, the longest); the output is the text before that sequence,
which is not included. While generating, the tail of the text that could still be the start
of a stop sequence is held back, so no emitted character is ever retracted and any split of
the text into deltas emits the same text and stops at the same place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron.core.errors import MegatronInputError


class InvalidStopSequencesError(MegatronInputError):
    """``stop`` was not a string or a list of non-empty strings."""


def normalize_stop_sequences(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Validate a request's ``stop`` (None, one string, or a list of strings) into a tuple."""
    if stop is None:
        return ()
    sequences = (stop,) if isinstance(stop, str) else stop
    if not isinstance(sequences, (list, tuple)) or not all(isinstance(s, str) and s for s in sequences):
        raise InvalidStopSequencesError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return tuple(sequences)


class StopSequenceFinishedError(MegatronInputError):
    """The matcher was fed after it stopped or was finished."""


@dataclass(frozen=True)
class StopCheck:
    """What one delta settles: ``text`` to emit now and whether generation stops here."""

    text: str
    stopped: bool


class StopSequenceMatcher:
    """Watches the detokenized output of one request for its stop sequences.

    ``stops``: the request's normalized stop sequences (``SamplingParams.stop``, see
    :func:`normalize_stop_sequences`).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._pending = ""
        self._done = False

    @property
    def held_chars(self) -> int:
        """Characters held back as a possible start of a stop sequence (< longest stop)."""
        return len(self._pending)

    def feed(self, delta: str, can_stop: bool = True) -> StopCheck:
        """Add the next text delta; return the text now safe to emit and whether to stop.
        ``can_stop=False``: stop sequences completed in this text are not stops (they are
        emitted); a possible start of one is still held back for the next delta."""
        if self._done:
            raise StopSequenceFinishedError("feed() was called after the output stopped or finished")
        text = self._pending + delta
        stop_at = _earliest_completed_stop(text, self._stops) if can_stop else None
        if stop_at is not None:
            self._pending, self._done = "", True
            return StopCheck(text[:stop_at], stopped=True)
        hold = _longest_suffix_starting_a_stop(text, self._stops)
        self._pending = text[len(text) - hold :]
        return StopCheck(text[: len(text) - hold], stopped=False)

    def finish(self) -> str:
        """Generation ended for another reason (EOS, length): return the held-back text."""
        if self._done:
            raise StopSequenceFinishedError("finish() was called after the output stopped or finished")
        text, self._pending, self._done = self._pending, "", True
        return text


def _earliest_completed_stop(text: str, stops: Sequence[str]) -> int | None:
    """Start of the stop sequence that completes first in ``text`` (longest on a tie), or None."""
    best: tuple[int, int] | None = None  # (end, start)
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best):
            best = (start + len(stop), start)
    return None if best is None else best[1]


def _longest_suffix_starting_a_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop sequence."""
    longest = max((len(stop) for stop in stops), default=1)
    for length in range(min(len(text), longest - 1), 0, -1):
        tail = text[len(text) - length :]
        if any(stop.startswith(tail) and len(stop) > length for stop in stops):
            return length
    return 0
