"""One choice of an HTTP request: engine outputs -> text deltas, with stop sequences applied.

Text is decoded incrementally: a delta is released only once the tokens decode to complete
characters (a multi-byte character split across tokens is held back), and the tail that
could still start a stop sequence is held by a :class:`StopSequenceMatcher`. When a stop
sequence completes, the choice finishes with ``"stop"`` and the engine request is aborted;
the text before the stop sequence is all that is emitted.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.core.inference.coordinator.client import RequestHandle
from megatron.core.inference.stop_words import StopSequenceMatcher

# JSON has no infinities; a -inf log-probability is reported as this.
MIN_LOG_PROB = -9999.0


def finite_log_prob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOG_PROB


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas that never change once emitted."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window re-decoded for context
        self._read_offset = 0  # tokens whose text was already emitted

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text."""
        self._ids.extend(token_ids)
        emitted = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """The text still held back (incomplete characters decode to U+FFFD)."""
        emitted = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(emitted) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.detokenize(self._ids[start:end]) if end > start else ""


@dataclass
class ChoiceDelta:
    """What one engine output adds to a choice."""

    text: str
    token_ids: list[int]
    log_probs: list[float]
    top_log_probs: list[list[tuple[int, float]]] | None
    finish_reason: str | None = None
    error: dict | None = None
    prompt_log_probs: list[float] | None = None


@dataclass
class ChoiceState:
    """Counts of one choice so far (for usage)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: dict | None = None
    stopped_by_sequence: bool = False


class ChoiceDecoder:
    """Turns the engine outputs of one request into :class:`ChoiceDelta` s."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._matcher = StopSequenceMatcher(list(stop))
        self.state = ChoiceState()

    def feed(self, output: dict[str, Any]) -> ChoiceDelta:
        tokens = list(output["new_token_ids"])
        state = self.state
        state.prompt_tokens = output["prompt_tokens"]
        state.completion_tokens += len(tokens)
        check = self._matcher.feed(self._detokenizer.add(tokens))
        text, reason = check.text, None
        if check.stopped:
            reason, state.stopped_by_sequence = "stop", True
        elif output["finished"]:
            tail = self._matcher.feed(self._detokenizer.flush())
            text += tail.text
            if tail.stopped:
                reason, state.stopped_by_sequence = "stop", True
            else:
                text += self._matcher.finish()
                reason = output["finish_reason"]
        if reason is not None:
            state.finish_reason, state.error = reason, output.get("error")
        top = output.get("new_top_log_probs")
        return ChoiceDelta(
            text=text,
            token_ids=tokens,
            log_probs=[finite_log_prob(lp) for lp in output.get("new_log_probs") or []],
            top_log_probs=[[(int(t), finite_log_prob(lp)) for t, lp in row] for row in top] if top else None,
            finish_reason=reason,
            error=state.error if reason is not None else None,
            prompt_log_probs=output.get("prompt_log_probs"),
        )


async def choice_deltas(
    handle: RequestHandle, decoder: ChoiceDecoder, first: dict | None = None
) -> AsyncIterator[ChoiceDelta]:
    """Stream a request's deltas until it finishes; abort it in the engine if we stop early.

    ``first`` is an output already taken from the handle (it is decoded first).
    """
    try:
        if first is not None:
            delta = decoder.feed(first)
            yield delta
            if delta.finish_reason is not None:
                return
        async for output in handle:
            delta = decoder.feed(output)
            yield delta
            if delta.finish_reason is not None:
                return
    finally:
        if not handle.done:
            handle.abort()
