"""Helpers of the parser tests: texts built from marker fragments, random splits, and a driver
that streams a text through a parser checking stable emission at every step."""

from __future__ import annotations

import json
from itertools import pairwise

from hypothesis import strategies as st

from megatron.core.inference.parsers import ParsedOutput, ToolCallEvent, collect

FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<",
    "</",
    "<t",
    "</thi",
    "<tool_",
    "</tool_ca",
    "<func",
    "think>",
    "call>",
    "f>",
    "n>",
    "s>",
    "hello",
    "world",
    " ",
    "\n",
    "5",
    "abc",
    '{"name": "f", "arguments": {"a": [1, "x"]}}',
    '{"name": "g"}',
    '{"name": 3}',
    "{",
    "}",
    '{"name": "h", "arguments": "{\\"k\\": true}"}',
]

# Output texts: fragments glued together, so markers, partial markers and calls all occur.
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join)


def split_at(text: str, cuts: list[int]) -> list[str]:
    """Split ``text`` at the given positions (sorted, deduplicated; empty pieces kept)."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


@st.composite
def text_and_pieces(draw, text_strategy=texts):
    """A text and one way of cutting it into deltas (including empty deltas)."""
    text = draw(text_strategy)
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 2))
    return text, split_at(text, cuts)


def sequential_ids(index: int) -> str:
    return f"call_{index}"


def stream(parser, pieces: list[str], whole: ParsedOutput, max_pending: int | None) -> ParsedOutput:
    """Feed ``pieces`` to ``parser``; after every delta the streamed channels must be prefixes of
    ``whole`` (nothing emitted is ever moved) and at most ``max_pending`` characters held."""
    sofar = ParsedOutput()
    for piece in [*pieces, None]:
        events = parser.feed(piece) if piece is not None else parser.finish()
        assert all(isinstance(e, ToolCallEvent) or e.text for e in events), "empty text event"
        new = collect(events)
        sofar = ParsedOutput(
            sofar.reasoning + new.reasoning, sofar.content + new.content, sofar.tool_calls + new.tool_calls
        )
        assert whole.reasoning.startswith(sofar.reasoning)
        assert whole.content.startswith(sofar.content)
        assert sofar.tool_calls == whole.tool_calls[: len(sofar.tool_calls)]
        if max_pending is not None:
            assert parser.pending_marker_chars <= max_pending
    return sofar


def assert_well_formed_calls(calls: list[ToolCallEvent]) -> None:
    """Calls are numbered 0.. in order, each with a name and JSON-object arguments."""
    assert [call.index for call in calls] == list(range(len(calls)))
    for call in calls:
        assert call.name and call.id.startswith("call_")
        assert isinstance(json.loads(call.arguments), dict)
