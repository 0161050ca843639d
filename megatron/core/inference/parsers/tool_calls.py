"""Streaming extraction of tool calls from the content channel.

A call is the text between an opening and a closing delimiter. The text inside an open call
is buffered (it is neither content nor a call yet); when the call closes, its body is parsed
by the format: a well-formed call is emitted once as a :class:`ToolCallEvent` with a fresh id,
the next index and its arguments as JSON; a malformed call is emitted as literal content,
delimiters included, and so is a call still open when the output ends. Delimiters are
boundaries only when the request offered tools; otherwise all text is content.

Formats:
- Hermes: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``.
- Qwen3-coder: ``<tool_call><function=f><parameter=p>value</parameter>...</function></tool_call>``;
  the model sometimes drops the ``<tool_call>`` wrapper, so a bare
  ``<function=f>...</function>`` is a call too. Parameter values are raw text (one newline
  after the opening and before the closing tag is dropped); a value whose parameter the
  request's tool schema types as anything but ``string`` is decoded as JSON when it can be.
"""

from __future__ import annotations

import abc
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron.core.inference.parsers.base import Channel, Event, MarkerStreamParser, TextEvent, ToolCallEvent

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# name -> {parameter -> JSON-schema type}, from the request's tools.
ParameterTypes = Mapping[str, Mapping[str, Any]]


class ToolCallFormat(abc.ABC):
    """How calls are delimited and how a call's body is read."""

    @property
    @abc.abstractmethod
    def delimiters(self) -> Mapping[str, str]:
        """Opening marker -> closing marker of a call."""

    @abc.abstractmethod
    def parse_call(self, opening: str, body: str, parameter_types: ParameterTypes) -> tuple[str, dict] | None:
        """Return ``(name, arguments)`` of the call, or None when it is malformed."""


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; arguments may also be a JSON string."""

    delimiters = {TOOL_CALL_OPEN: TOOL_CALL_CLOSE}

    def parse_call(self, opening: str, body: str, parameter_types: ParameterTypes) -> tuple[str, dict] | None:
        call = _json_or_none(body)
        if not isinstance(call, dict):
            return None
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json_or_none(arguments)
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return name, arguments


class Qwen3CoderFormat(ToolCallFormat):
    """XML-style calls of Qwen3-coder, wrapped in ``<tool_call>`` or bare ``<function=...>``."""

    delimiters = {TOOL_CALL_OPEN: TOOL_CALL_CLOSE, FUNCTION_OPEN: FUNCTION_CLOSE}

    def parse_call(self, opening: str, body: str, parameter_types: ParameterTypes) -> tuple[str, dict] | None:
        if opening == TOOL_CALL_OPEN:
            body = body.strip()
            if not (body.startswith(FUNCTION_OPEN) and body.endswith(FUNCTION_CLOSE)):
                return None
            body = body[len(FUNCTION_OPEN) : -len(FUNCTION_CLOSE)]
        name, sep, rest = body.partition(">")
        name = name.strip()
        if not sep or not name or any(ch.isspace() or ch in "<>" for ch in name):
            return None
        arguments = _parse_parameters(rest, parameter_types.get(name, {}))
        return None if arguments is None else (name, arguments)


def _parse_parameters(text: str, types: Mapping[str, Any]) -> dict | None:
    arguments: dict[str, Any] = {}
    rest = text.lstrip()
    while rest:
        if not rest.startswith(PARAMETER_OPEN):
            return None
        key, sep, rest = rest[len(PARAMETER_OPEN) :].partition(">")
        key = key.strip()
        value, closed, rest = rest.partition(PARAMETER_CLOSE)
        if not sep or not key or not closed or key in arguments:
            return None
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[key] = value if types.get(key, "string") == "string" else _json_or_default(value)
        rest = rest.lstrip()
    return arguments


def _strict_json(text: str) -> Any:
    """Decode JSON, refusing NaN and Infinity (they would not re-encode as valid JSON)."""
    return json.loads(text, parse_constant=_reject_constant)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_or_none(text: str) -> Any:
    try:
        return _strict_json(text)
    except ValueError:
        return None


def _json_or_default(text: str) -> Any:
    try:
        return _strict_json(text)
    except ValueError:
        return text


def parameter_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Map each offered function to its parameters' JSON-schema types.

    Accepts OpenAI tools (``{"type": "function", "function": {...}}``) or bare function objects.
    """
    types: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {
            key: schema.get("type", "string") for key, schema in properties.items() if isinstance(schema, Mapping)
        }
    return types


def random_call_id(index: int) -> str:
    """An OpenAI-style call id, ``call_`` and 24 random hex digits (the index is not needed)."""
    return "call_" + secrets.token_hex(12)


class ToolCallParser(MarkerStreamParser):
    """Turns the content stream into content text and tool calls.

    Args:
        call_format: the model's tool-call syntax.
        tools: the tools offered by the request; None or empty means tools were not
            requested, and then every delimiter is literal content.
        id_factory: gives the id of the call at an index (default: random ``call_<hex>``).
    """

    def __init__(
        self,
        call_format: ToolCallFormat,
        tools: Sequence[Mapping[str, Any]] | None,
        id_factory: Callable[[int], str] = random_call_id,
    ) -> None:
        super().__init__()
        self._format = call_format
        self._tools_requested = bool(tools)
        self._parameter_types = parameter_types(tools)
        self._id_factory = id_factory
        self._opening: str | None = None
        self._body: list[str] = []
        self._num_calls = 0

    def _live_markers(self) -> Sequence[str]:
        if not self._tools_requested:
            return ()
        if self._opening is not None:
            return (self._format.delimiters[self._opening],)
        return tuple(self._format.delimiters)

    def _on_text(self, text: str) -> list[Event]:
        if self._opening is not None:
            self._body.append(text)
            return []
        return [TextEvent(Channel.CONTENT, text)]

    def _on_marker(self, marker: str) -> list[Event]:
        if self._opening is None:
            self._opening, self._body = marker, []
            return []
        opening, body = self._opening, "".join(self._body)
        self._opening, self._body = None, []
        call = self._format.parse_call(opening, body, self._parameter_types)
        if call is None:
            return [TextEvent(Channel.CONTENT, opening + body + marker)]
        name, arguments = call
        index, self._num_calls = self._num_calls, self._num_calls + 1
        return [ToolCallEvent(index, self._id_factory(index), name, json.dumps(arguments, ensure_ascii=False))]

    def _on_end(self) -> list[Event]:
        if self._opening is None:
            return []
        # A call left open at the end was never a call.
        text = self._opening + "".join(self._body)
        self._opening, self._body = None, []
        return [TextEvent(Channel.CONTENT, text)]


def hermes_tool_call_parser(
    tools: Sequence[Mapping[str, Any]] | None, id_factory: Callable[[int], str] = random_call_id
) -> ToolCallParser:
    """Tool-call parser for Hermes JSON calls."""
    return ToolCallParser(HermesFormat(), tools, id_factory)


def qwen3_coder_tool_call_parser(
    tools: Sequence[Mapping[str, Any]] | None, id_factory: Callable[[int], str] = random_call_id
) -> ToolCallParser:
    """Tool-call parser for Qwen3-coder XML calls."""
    return ToolCallParser(Qwen3CoderFormat(), tools, id_factory)
