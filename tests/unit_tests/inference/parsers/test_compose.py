"""Reasoning parser then tool-call parser: the composition streams its whole-output parse, which
equals the reasoning reference followed by the tool-call reference on the content."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.core.inference.parsers import (
    ParsedOutput,
    ToolCallEvent,
    UnknownParserError,
    build_output_parser,
)
from megatron.core.inference.parsers.base import MarkerSplitter

from . import test_reasoning, test_tool_calls
from .streaming import assert_well_formed_calls, sequential_ids, split_at, stream, text_and_pieces

MAX_PENDING = len("</tool_call>") - 1
think_markers = st.sampled_from(["<think>", "</think>", "</thi", "<th", ""])
composed_outputs = st.one_of(
    st.lists(st.one_of(test_tool_calls.segments, think_markers), max_size=8).map("".join),
    # reasoning, a (possibly broken) close tag, then content with calls
    st.tuples(
        test_tool_calls.outputs_with_calls,
        st.sampled_from(["</think>", "</think>\n", "</thi"]),
        test_tool_calls.outputs_with_calls,
    ).map("".join),
)


def build(reasoning, tools_format, tools, options):
    return build_output_parser(
        reasoning, tools_format, tools=tools, reasoning_options=options, id_factory=sequential_ids
    )


def test_reasoning_then_tool_call_then_content():
    text = 'plan</think>Calling.<tool_call>{"name": "f", "arguments": {"n": 1}}</tool_call>done'
    whole = build("deepseek_r1", "hermes", test_tool_calls.TOOLS, {}).parse_whole(text)
    assert whole == ParsedOutput("plan", "Calling.done", [ToolCallEvent(0, "call_0", "f", '{"n": 1}')])


def test_tool_markers_inside_reasoning_are_reasoning_text():
    text = '<tool_call>{"name": "f"}</tool_call></think>x'
    whole = build("deepseek_r1", "hermes", test_tool_calls.TOOLS, {}).parse_whole(text)
    assert whole == ParsedOutput('<tool_call>{"name": "f"}</tool_call>', "x")


def test_without_stages_everything_is_content():
    assert build_output_parser().parse_whole("<think>a</think>") == ParsedOutput("", "<think>a</think>")


def test_unknown_parser_names_are_refused_with_the_accepted_names():
    with pytest.raises(UnknownParserError, match="unknown reasoning parser 'r2'; accepted: deepseek_r1, nemotron"):
        build_output_parser("r2")
    with pytest.raises(UnknownParserError, match="unknown tool-call parser 'json'; accepted: hermes, qwen3_coder"):
        build_output_parser(None, "json")


COMBINATIONS = [
    ("deepseek_r1", "hermes", {}),
    ("deepseek_r1", "qwen3_coder", {"starts_in_reasoning": False}),
    ("nemotron", "hermes", {"thinking_enabled": False}),
    ("nemotron", "qwen3_coder", {"force_nonempty_content": True}),
]


@pytest.mark.parametrize("reasoning,tools_format,options", COMBINATIONS)
@settings(max_examples=100, deadline=None)
@given(case=text_and_pieces(composed_outputs))
def test_any_split_streams_the_whole_output_parse(reasoning, tools_format, options, case):
    text, pieces = case
    tools = test_tool_calls.TOOLS
    whole = build(reasoning, tools_format, tools, options).parse_whole(text)
    split = test_reasoning.reference(text, **options)
    calls = test_tool_calls.reference(split.content, test_tool_calls.PARSERS[tools_format][1], tools)
    assert whole == ParsedOutput(split.reasoning, calls.content, calls.tool_calls)
    assert_well_formed_calls(whole.tool_calls)
    max_pending = None if options.get("force_nonempty_content") else MAX_PENDING
    assert stream(build(reasoning, tools_format, tools, options), pieces, whole, max_pending) == whole
    assert stream(build(reasoning, tools_format, tools, options), list(text), whole, max_pending) == whole


OVERLAPPING_MARKERS = ["ab", "abc", "bcd", "c"]


def split_stream(text_pieces, markers):
    splitter, pieces = MarkerSplitter(), []
    for delta in text_pieces:
        splitter.append(delta)
        while (piece := splitter.take(markers, final=False)) is not None:
            pieces.append(piece)
        assert splitter.held_chars < max(map(len, markers))
    while (piece := splitter.take(markers, final=True)) is not None:
        pieces.append(piece)
    return pieces


def merged(pieces):
    """Adjacent literal pieces joined (literal text may be cut anywhere)."""
    out = []
    for text, is_marker in pieces:
        if out and not is_marker and not out[-1][1]:
            out[-1] = (out[-1][0] + text, False)
        else:
            out.append((text, is_marker))
    return out


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcd", max_size=16), data=st.data())
def test_splitter_is_leftmost_longest_under_any_split(text, data):
    # Reference: a regex alternation tried longest first is leftmost-longest.
    pattern = "|".join(sorted(OVERLAPPING_MARKERS, key=len, reverse=True))
    expected, at = [], 0
    for match in re.finditer(pattern, text):
        expected += [(text[at : match.start()], False)] if match.start() > at else []
        expected.append((match.group(), True))
        at = match.end()
    expected += [(text[at:], False)] if at < len(text) else []
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    assert merged(split_stream(split_at(text, cuts), OVERLAPPING_MARKERS)) == expected
