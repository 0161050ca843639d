"""Shared machinery of the streaming output parsers: events, marker hold-back, whole-output parse.

A parser turns the text deltas of one generated output into events on three channels:
reasoning text, content text and tool calls. The one property every parser keeps is
*stable emission*: an event, once returned, is final. Text is never emitted on one channel
and later moved to another, so the concatenation of the streamed events equals the parse
of the whole output (:meth:`StreamParser.parse_whole`, which runs the very same code).

Markers (``<think>``, ``</tool_call>``...) may arrive split across deltas. A
:class:`MarkerSplitter` holds back only the tail of the text that is still a proper prefix
of a marker, so at most ``longest marker length - 1`` characters wait for the next delta.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from megatron.core.errors import MegatronInputError


class Channel(enum.StrEnum):
    """The text channels of a chat completion."""

    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class TextEvent:
    """Text appended to one channel."""

    channel: Channel
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """One complete tool call, emitted once when the call closes.

    ``index`` counts the calls of this output from 0; ``arguments`` is a JSON object text.
    """

    index: int
    id: str
    name: str
    arguments: str


Event = TextEvent | ToolCallEvent


class ParserFinishedError(MegatronInputError):
    """A parser was fed after :meth:`StreamParser.finish`; each output needs a fresh parser."""


@dataclass
class ParsedOutput:
    """The three channels of an output, as concatenated from its events."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallEvent] = field(default_factory=list)


def collect(events: Iterable[Event]) -> ParsedOutput:
    """Concatenate events into a :class:`ParsedOutput`."""
    reasoning: list[str] = []
    content: list[str] = []
    tool_calls: list[ToolCallEvent] = []
    for event in events:
        if isinstance(event, ToolCallEvent):
            tool_calls.append(event)
        elif event.channel is Channel.REASONING:
            reasoning.append(event.text)
        else:
            content.append(event.text)
    return ParsedOutput("".join(reasoning), "".join(content), tool_calls)


class StreamParser(abc.ABC):
    """A parser fed the text deltas of one output; see the module docstring for its contract."""

    @abc.abstractmethod
    def feed(self, delta: str) -> list[Event]:
        """Consume the next text delta and return the events it settles."""

    @abc.abstractmethod
    def finish(self) -> list[Event]:
        """End the output: resolve everything still held and return the last events."""

    @property
    @abc.abstractmethod
    def pending_marker_chars(self) -> int:
        """Characters held back because they may still be the start of a marker."""

    def parse_whole(self, text: str) -> ParsedOutput:
        """Non-streaming parse of a whole output: ``feed(text)`` then ``finish()`` on this fresh parser."""
        return collect([*self.feed(text), *self.finish()])


class MarkerSplitter:
    """Splits a text stream into literal pieces and markers, leftmost-longest.

    Text is appended with :meth:`append`; :meth:`take` then returns the next settled piece
    under the marker set the caller is in now (the set may change after every piece, so a
    caller takes one piece at a time). A literal piece is returned only once no marker can
    begin inside it, whatever text follows; the tail that is still a proper prefix of a
    marker stays held, so the held text is shorter than the longest marker.
    """

    def __init__(self) -> None:
        self._buffer = ""

    def append(self, text: str) -> None:
        self._buffer += text

    @property
    def held_chars(self) -> int:
        return len(self._buffer)

    def take(self, markers: Sequence[str], final: bool) -> tuple[str, bool] | None:
        """Return the next settled piece as ``(text, is_marker)``, or None when nothing is settled.

        With ``final`` the stream has ended: a partial marker can no longer complete, so the
        whole remaining buffer is settled.
        """
        buffer = self._buffer
        if not buffer:
            return None
        match_at, match = _leftmost_longest_match(buffer, markers)
        partial_at = None if final else _first_partial_marker(buffer, markers)
        if match is not None and (partial_at is None or match_at < partial_at):
            if match_at > 0:
                return self._consume(match_at, is_marker=False)
            return self._consume(len(match), is_marker=True)
        if partial_at is None:
            return self._consume(len(buffer), is_marker=False)
        if partial_at > 0:
            return self._consume(partial_at, is_marker=False)
        return None

    def _consume(self, length: int, is_marker: bool) -> tuple[str, bool]:
        piece, self._buffer = self._buffer[:length], self._buffer[length:]
        return piece, is_marker


def _leftmost_longest_match(text: str, markers: Sequence[str]) -> tuple[int, str | None]:
    best_at, best = len(text), None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (at < best_at or (at == best_at and len(marker) > len(best))):
            best_at, best = at, marker
    return best_at, best


def _first_partial_marker(text: str, markers: Sequence[str]) -> int | None:
    """Earliest position whose suffix is a proper prefix of a marker (a marker cut by the end)."""
    longest = max((len(marker) for marker in markers), default=0)
    for at in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[at:]
        if any(len(marker) > len(tail) and marker.startswith(tail) for marker in markers):
            return at
    return None


class MarkerStreamParser(StreamParser):
    """A state machine driven by the pieces of a :class:`MarkerSplitter`.

    Subclasses say which markers are live in the current state and react to literal text and
    to markers. ``_on_text`` must treat ``"ab"`` exactly like ``"a"`` then ``"b"`` (text may be
    split anywhere), which is what makes streaming and whole-output parsing agree.
    """

    def __init__(self) -> None:
        self._splitter = MarkerSplitter()
        self._finished = False

    @abc.abstractmethod
    def _live_markers(self) -> Sequence[str]:
        """Markers that are boundaries in the current state."""

    @abc.abstractmethod
    def _on_text(self, text: str) -> list[Event]:
        """Handle settled literal text."""

    @abc.abstractmethod
    def _on_marker(self, marker: str) -> list[Event]:
        """Handle a complete marker (one of :meth:`_live_markers`)."""

    @abc.abstractmethod
    def _on_end(self) -> list[Event]:
        """Flush state left open when the output ends (all literal text was handled already)."""

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise ParserFinishedError("feed() was called after finish(); use a new parser for each output")
        self._splitter.append(delta)
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        if self._finished:
            raise ParserFinishedError("finish() was called twice; use a new parser for each output")
        events = self._drain(final=True)
        self._finished = True
        return events + self._on_end()

    @property
    def pending_marker_chars(self) -> int:
        return self._splitter.held_chars

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while (piece := self._splitter.take(self._live_markers(), final)) is not None:
            text, is_marker = piece
            events += self._on_marker(text) if is_marker else self._on_text(text)
        return events
