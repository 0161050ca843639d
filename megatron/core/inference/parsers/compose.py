"""The output parser of one chat completion: reasoning parser, then tool-call parser on its content."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron.core.errors import MegatronConfigError
from megatron.core.inference.parsers.base import Channel, Event, StreamParser, TextEvent
from megatron.core.inference.parsers.reasoning import deepseek_r1_reasoning_parser, nemotron_reasoning_parser
from megatron.core.inference.parsers.tool_calls import (
    hermes_tool_call_parser,
    qwen3_coder_tool_call_parser,
    random_call_id,
)

REASONING_PARSERS: dict[str, Callable[..., StreamParser]] = {
    "deepseek_r1": deepseek_r1_reasoning_parser,
    "nemotron": nemotron_reasoning_parser,
}
TOOL_CALL_PARSERS: dict[str, Callable[..., StreamParser]] = {
    "hermes": hermes_tool_call_parser,
    "qwen3_coder": qwen3_coder_tool_call_parser,
}


class UnknownParserError(MegatronConfigError):
    """A reasoning or tool-call parser name that is not registered."""


class ChatOutputParser(StreamParser):
    """Runs ``reasoning`` over the output and ``tool_calls`` over the content it yields.

    Either stage may be None (no reasoning split; no tool-call extraction). Events keep the
    order in which their text appeared in the output.
    """

    def __init__(self, reasoning: StreamParser | None, tool_calls: StreamParser | None) -> None:
        self._reasoning = reasoning
        self._tool_calls = tool_calls

    def feed(self, delta: str) -> list[Event]:
        events = self._reasoning.feed(delta) if self._reasoning else [TextEvent(Channel.CONTENT, delta)]
        return self._route(events)

    def finish(self) -> list[Event]:
        events = self._route(self._reasoning.finish()) if self._reasoning else []
        return events + (self._tool_calls.finish() if self._tool_calls else [])

    @property
    def pending_marker_chars(self) -> int:
        return sum(stage.pending_marker_chars for stage in (self._reasoning, self._tool_calls) if stage)

    def _route(self, events: list[Event]) -> list[Event]:
        if self._tool_calls is None:
            return [event for event in events if not isinstance(event, TextEvent) or event.text]
        routed: list[Event] = []
        for event in events:
            if isinstance(event, TextEvent) and event.channel is Channel.CONTENT:
                routed += self._tool_calls.feed(event.text)
            elif not isinstance(event, TextEvent) or event.text:
                routed.append(event)
        return routed


def build_output_parser(
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_options: Mapping[str, Any] | None = None,
    id_factory: Callable[[int], str] = random_call_id,
) -> ChatOutputParser:
    """Build the parser of one output from registered names (the server's flags).

    Args:
        reasoning_parser: a key of :data:`REASONING_PARSERS`, or None.
        tool_call_parser: a key of :data:`TOOL_CALL_PARSERS`, or None.
        tools: the request's tools; without them tool-call delimiters are literal content.
        reasoning_options: keyword options of the reasoning parser factory
            (e.g. ``thinking_enabled``, ``force_nonempty_content``, ``starts_in_reasoning``).
        id_factory: tool-call id for a call index.
    """
    reasoning = None
    if reasoning_parser is not None:
        reasoning = _lookup(REASONING_PARSERS, reasoning_parser, "reasoning parser")(**(reasoning_options or {}))
    tool_calls = None
    if tool_call_parser is not None:
        tool_calls = _lookup(TOOL_CALL_PARSERS, tool_call_parser, "tool-call parser")(tools, id_factory)
    return ChatOutputParser(reasoning, tool_calls)


def _lookup(registry: Mapping[str, Callable[..., StreamParser]], name: str, what: str) -> Callable[..., StreamParser]:
    if name not in registry:
        raise UnknownParserError(f"unknown {what} {name!r}; accepted: {', '.join(sorted(registry))}")
    return registry[name]
