"""One choice of an HTTP request: engine outputs -> choice deltas.

The engine owns the text: its outputs carry ``new_text`` (detokenized incrementally, cut before
the first stop sequence, which ends the request with finish reason ``"stop"``). This module
only reshapes an output for the routes (text, token ids, finite log-probs, the finish) and
counts the tokens for usage: exactly the tokens the engine reported.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from megatron.core.inference.coordinator.client import RequestHandle

# JSON has no infinities; a -inf log-probability is reported as this.
MIN_LOG_PROB = -9999.0
# The error of a choice whose engine sends tokens without text (it has no tokenizer).
ENGINE_WITHOUT_TOKENIZER = {
    "type": "EngineWithoutTokenizerError",
    "message": "the engine reports tokens without text: serve an engine built with a tokenizer",
    "details": {},
}


def finite_log_prob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOG_PROB


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


class ChoiceDecoder:
    """Turns the engine outputs of one request into :class:`ChoiceDelta` s."""

    def __init__(self):
        self.state = ChoiceState()

    def feed(self, output: dict[str, Any]) -> ChoiceDelta:
        """The delta of one engine output (the output dict of ``RequestOutput.to_dict()``)."""
        tokens = list(output["new_token_ids"])
        text = output["new_text"]
        reason, error = output["finish_reason"], output.get("error")
        if text is None and tokens:  # ends the choice (choice_deltas then aborts the request)
            tokens, reason, error = [], "error", ENGINE_WITHOUT_TOKENIZER
        state = self.state
        state.prompt_tokens = output["prompt_tokens"]
        state.completion_tokens += len(tokens)
        if reason is not None:
            state.finish_reason, state.error = reason, error
        top = output.get("new_top_log_probs")
        return ChoiceDelta(
            text=text or "",
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
