"""OpenAI response and chunk bodies (plain dicts), and the log-prob formats of both APIs."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from megatron.core.inference.parsers import Channel, Event, TextEvent, ToolCallEvent


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.detokenize([token_id], skip_special_tokens=False)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(kind: str, request_id: str, model: str, created: int, choices: list, **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}


def now() -> int:
    return int(time.time())


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class CompletionLogProbs:
    """The ``logprobs`` object of a completion choice, built token by token.

    ``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: lp}] | None, "text_offset": [...]}``
    """

    def __init__(self, tokenizer, top: bool, text_offset: int = 0):
        self._tokenizer = tokenizer
        self._top = top
        self._offset = text_offset

    def build(
        self,
        token_ids: Sequence[int],
        log_probs: Sequence[float | None],
        top_log_probs: Sequence[Sequence[tuple[int, float]]] | None,
    ) -> dict[str, Any]:
        tokens = [token_text(self._tokenizer, t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        tops = None
        if self._top:
            rows = top_log_probs or [
                [(t, lp)] if lp is not None else [] for t, lp in zip(token_ids, log_probs, strict=True)
            ]
            tops = [{token_text(self._tokenizer, t): lp for t, lp in row} or None for row in rows]
        return {"tokens": tokens, "token_logprobs": list(log_probs), "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in ("tokens", "token_logprobs", "text_offset"):
            merged[key] += part[key]
        merged["top_logprobs"] = None if part["top_logprobs"] is None else merged["top_logprobs"] + part["top_logprobs"]
    return merged


def chat_logprobs_content(
    tokenizer,
    token_ids: Sequence[int],
    log_probs: Sequence[float],
    top_log_probs: Sequence[Sequence[tuple[int, float]]] | None,
    num_top: int,
) -> list[dict[str, Any]]:
    """Entries of a chat choice's ``logprobs.content``."""

    def entry(token_id: int, log_prob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token_id, log_prob) in enumerate(zip(token_ids, log_probs, strict=True)):
        row = top_log_probs[i] if top_log_probs else [(token_id, log_prob)]
        content.append({**entry(token_id, log_prob), "top_logprobs": [entry(t, lp) for t, lp in row[:num_top]]})
    return content


def tool_call_dict(event: ToolCallEvent, with_index: bool) -> dict[str, Any]:
    call = {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": event.arguments}}
    return {"index": event.index, **call} if with_index else call


def chat_delta(events: Sequence[Event]) -> dict[str, Any]:
    """The ``delta`` of a chat chunk carrying ``events`` (empty dict when there is nothing)."""
    delta: dict[str, Any] = {}
    for event in events:
        if isinstance(event, ToolCallEvent):
            delta.setdefault("tool_calls", []).append(tool_call_dict(event, with_index=True))
        elif isinstance(event, TextEvent) and event.text:
            key = "reasoning_content" if event.channel is Channel.REASONING else "content"
            delta[key] = delta.get(key, "") + event.text
    return delta


def chat_finish_reason(reason: str, made_tool_calls: bool) -> str:
    return "tool_calls" if made_tool_calls and reason == "stop" else reason
