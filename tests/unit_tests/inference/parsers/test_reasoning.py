"""Reasoning/content split: hand-checked examples, and for every split of every output the
stream equals the whole-output parse, which equals an independent reference."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.core.inference.parsers import (
    Channel,
    ParsedOutput,
    ParserFinishedError,
    TextEvent,
    deepseek_r1_reasoning_parser,
    nemotron_reasoning_parser,
)

from .streaming import split_at, stream, text_and_pieces

MAX_PENDING = len("</think>") - 1


def reference(text, *, starts_in_reasoning=True, thinking_enabled=True, force_nonempty_content=False):
    """The documented grammar, written directly on the whole text."""
    if not thinking_enabled:
        return ParsedOutput("", text)
    if text.startswith("<think>"):
        text, starts_in_reasoning = text[len("<think>") :], True
    if starts_in_reasoning:
        reasoning, _, content = text.partition("</think>")
    else:
        reasoning, content = "", text
    if force_nonempty_content and not content.strip():
        reasoning, content = "", reasoning + content
    return ParsedOutput(reasoning, content)


def test_close_tag_split_across_deltas_is_held_then_resolved():
    parser = deepseek_r1_reasoning_parser()
    assert parser.feed("hello</thi") == [TextEvent(Channel.REASONING, "hello")]
    assert parser.pending_marker_chars == len("</thi")
    assert parser.feed("nk>world") == [TextEvent(Channel.CONTENT, "world")]
    assert parser.finish() == []


def test_unfinished_close_tag_is_flushed_as_literal_at_the_end():
    parser = deepseek_r1_reasoning_parser()
    parser.feed("hello</thi")
    assert parser.finish() == [TextEvent(Channel.REASONING, "</thi")]


def test_explicit_open_tag_is_consumed_only_at_the_start():
    assert deepseek_r1_reasoning_parser(starts_in_reasoning=False).parse_whole("<think>a</think>b") == ParsedOutput(
        "a", "b"
    )
    assert deepseek_r1_reasoning_parser(starts_in_reasoning=False).parse_whole("x<think>a</think>b") == ParsedOutput(
        "", "x<think>a</think>b"
    )
    assert deepseek_r1_reasoning_parser().parse_whole("<think>a</think>b<think>c</think>") == ParsedOutput(
        "a", "b<think>c</think>"
    )


def test_output_that_never_closes_reasoning_is_all_reasoning():
    assert deepseek_r1_reasoning_parser().parse_whole("still thinking") == ParsedOutput("still thinking", "")


def test_disabled_thinking_makes_everything_content():
    parser = nemotron_reasoning_parser(thinking_enabled=False)
    assert parser.parse_whole("<think>a</think>b") == ParsedOutput("", "<think>a</think>b")


def test_forced_content_reports_reasoning_as_content_when_no_content_follows():
    assert nemotron_reasoning_parser(force_nonempty_content=True).parse_whole("abc</think>\n\n") == ParsedOutput(
        "", "abc\n\n"
    )
    assert nemotron_reasoning_parser(force_nonempty_content=True).parse_whole("abc") == ParsedOutput("", "abc")


def test_forced_content_withholds_reasoning_until_content_is_known():
    parser = nemotron_reasoning_parser(force_nonempty_content=True)
    assert parser.feed("abc</think>") == []
    assert parser.feed(" \n") == []
    assert parser.feed("ok") == [TextEvent(Channel.REASONING, "abc"), TextEvent(Channel.CONTENT, " \nok")]
    assert parser.feed(" more") == [TextEvent(Channel.CONTENT, " more")]
    assert parser.finish() == []


def test_feeding_after_finish_is_refused():
    parser = deepseek_r1_reasoning_parser()
    parser.finish()
    with pytest.raises(ParserFinishedError, match="feed\\(\\) was called after finish\\(\\); use a new parser"):
        parser.feed("x")
    with pytest.raises(ParserFinishedError, match="finish\\(\\) was called twice"):
        parser.finish()


VARIANTS = [
    dict(starts_in_reasoning=True),
    dict(starts_in_reasoning=False),
    dict(starts_in_reasoning=True, thinking_enabled=False),
    dict(starts_in_reasoning=True, force_nonempty_content=True),
    dict(starts_in_reasoning=False, force_nonempty_content=True),
]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@settings(max_examples=150, deadline=None)
@given(case=text_and_pieces())
def test_any_split_streams_the_whole_output_parse(options, case):
    text, pieces = case
    whole = nemotron_reasoning_parser(**options).parse_whole(text)
    assert whole == reference(text, **options)
    # Forced-content mode withholds reasoning by design; every other mode holds < one marker.
    max_pending = None if options.get("force_nonempty_content") else MAX_PENDING
    assert stream(nemotron_reasoning_parser(**options), pieces, whole, max_pending) == whole
    assert stream(nemotron_reasoning_parser(**options), list(text), whole, max_pending) == whole


@settings(max_examples=100, deadline=None)
@given(reasoning=st.text(alphabet="ab<>/k \n", max_size=12), content=st.text(alphabet="ab<>/k \n", max_size=12))
def test_every_cut_inside_the_close_tag_gives_the_same_split(reasoning, content):
    text = f"{reasoning}</think>{content}"
    whole = deepseek_r1_reasoning_parser().parse_whole(text)
    start = len(reasoning)
    for cut in range(start, start + len("</think>") + 1):
        assert stream(deepseek_r1_reasoning_parser(), split_at(text, [cut]), whole, MAX_PENDING) == whole
