"""Tool-call extraction: hand-checked Hermes and Qwen3-coder calls, malformed calls as literal
content, and for every split of every output the stream equals the whole-output parse, which
equals a direct segmentation of the whole text."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.core.inference.parsers import (
    Channel,
    HermesFormat,
    ParsedOutput,
    Qwen3CoderFormat,
    TextEvent,
    ToolCallEvent,
    hermes_tool_call_parser,
    qwen3_coder_tool_call_parser,
)
from megatron.core.inference.parsers.tool_calls import parameter_types

from .streaming import FRAGMENTS, assert_well_formed_calls, sequential_ids, stream, text_and_pieces

MAX_PENDING = len("</tool_call>") - 1
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}},
            },
        },
    }
]
PARSERS = {
    "hermes": (hermes_tool_call_parser, HermesFormat()),
    "qwen3_coder": (qwen3_coder_tool_call_parser, Qwen3CoderFormat()),
}


def reference(text, call_format, tools):
    """Segment the whole text directly: earliest opening, then its first closing."""
    if not tools:
        return ParsedOutput("", text)
    content, calls, at = [], [], 0
    while True:
        hits = [(text.find(opening, at), opening) for opening in call_format.delimiters]
        hits = [hit for hit in hits if hit[0] >= 0]
        if not hits:
            content.append(text[at:])
            break
        start, opening = min(hits)
        closing = call_format.delimiters[opening]
        close = text.find(closing, start + len(opening))
        content.append(text[at:start])
        if close < 0:
            content.append(text[start:])
            break
        end = close + len(closing)
        call = call_format.parse_call(opening, text[start + len(opening) : close], parameter_types(tools))
        if call is None:
            content.append(text[start:end])
        else:
            index = len(calls)
            calls.append(ToolCallEvent(index, sequential_ids(index), call[0], json.dumps(call[1], ensure_ascii=False)))
        at = end
    return ParsedOutput("", "".join(content), calls)


def parse(name, text, tools=TOOLS):
    return PARSERS[name][0](tools, sequential_ids).parse_whole(text)


def test_hermes_call_after_content():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse("hermes", text) == ParsedOutput(
        "", "Let me check.", [ToolCallEvent(0, "call_0", "get_weather", '{"city": "Paris"}')]
    )


def test_hermes_arguments_given_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse("hermes", text).tool_calls == [ToolCallEvent(0, "call_0", "f", '{"a": 1}')]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": 3}',
        '{"arguments": {}}',
        "not json",
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": {"x": NaN}}',
    ],
)
def test_malformed_hermes_call_is_literal_content(body):
    text = f"a<tool_call>{body}</tool_call>b"
    assert parse("hermes", text) == ParsedOutput("", text)


def test_unclosed_call_is_flushed_as_literal_content():
    parser = hermes_tool_call_parser(TOOLS, sequential_ids)
    assert parser.feed('x<tool_call>{"name": "f"') == [TextEvent(Channel.CONTENT, "x")]
    assert [e.text for e in parser.finish()] == ['<tool_call>{"name": "f"']


def test_tool_markers_are_literal_when_tools_were_not_requested():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><function=f></function>'
    for name in PARSERS:
        for tools in (None, []):
            parser = PARSERS[name][0](tools, sequential_ids)
            assert parser.feed(text[:5]) != [] and parser.pending_marker_chars == 0
            assert parse(name, text, tools) == ParsedOutput("", text)


def test_each_call_gets_its_own_index_and_a_random_id():
    text = '<tool_call>{"name": "f"}</tool_call> and <tool_call>{"name": "g", "arguments": {"b": 2}}</tool_call>'
    calls = hermes_tool_call_parser(TOOLS).parse_whole(text).tool_calls
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "f", "{}"), (1, "g", '{"b": 2}')]
    assert calls[0].id != calls[1].id and all(len(c.id) == len("call_") + 24 for c in calls)


def test_qwen3_coder_wrapped_call_decodes_parameters_by_schema_type():
    text = (
        "Sure.\n<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\n42\n</parameter>\n"
        '<parameter=o>\n{"k": [1, 2]}\n</parameter>\n<parameter=extra>\nline1\nline2 <b>\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    calls = parse("qwen3_coder", text).tool_calls
    assert parse("qwen3_coder", text).content == "Sure.\n"
    assert [(c.index, c.id, c.name) for c in calls] == [(0, "call_0", "f")]
    assert json.loads(calls[0].arguments) == {"n": 42, "s": "42", "o": {"k": [1, 2]}, "extra": "line1\nline2 <b>"}


def test_qwen3_coder_bare_function_is_a_call():
    text = "a<function=g><parameter=x>1</parameter></function>b"
    assert parse("qwen3_coder", text) == ParsedOutput("", "ab", [ToolCallEvent(0, "call_0", "g", '{"x": "1"}')])


def test_qwen3_coder_typed_value_that_is_not_json_stays_text():
    text = "<function=f><parameter=n>many</parameter></function>"
    assert json.loads(parse("qwen3_coder", text).tool_calls[0].arguments) == {"n": "many"}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>hi <function=f></function></tool_call>",
        "<tool_call><function=f><parameter=x>1</function></tool_call>",
        "<function=f><parameter=x>1</parameter><parameter=x>2</parameter></function>",
        "<function=my f><parameter=x>1</parameter></function>",
        "<function=f>junk<parameter=x>1</parameter></function>",
        "<function=></function>",
    ],
)
def test_malformed_qwen3_coder_call_is_literal_content(text):
    assert parse("qwen3_coder", text) == ParsedOutput("", text)


def hermes_call(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def qwen_call(name, args, wrapped):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    call = f"<function={name}>\n{params}</function>"
    return f"<tool_call>\n{call}\n</tool_call>" if wrapped else call


arguments = st.dictionaries(
    st.sampled_from(["n", "s", "o", "q"]), st.sampled_from(["1", "x y", "{}", "<a>"]), max_size=3
)
segments = st.one_of(
    st.sampled_from(FRAGMENTS),
    st.builds(hermes_call, st.sampled_from(["f", "g"]), arguments),
    st.builds(qwen_call, st.sampled_from(["f", "g"]), arguments, st.booleans()),
)
outputs_with_calls = st.lists(segments, max_size=8).map("".join)


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
@settings(max_examples=100, deadline=None)
@given(case=text_and_pieces(outputs_with_calls))
def test_any_split_streams_the_whole_output_parse(name, tools, case):
    text, pieces = case
    factory, call_format = PARSERS[name]
    whole = factory(tools, sequential_ids).parse_whole(text)
    assert whole == reference(text, call_format, tools)
    assert_well_formed_calls(whole.tool_calls)
    assert stream(factory(tools, sequential_ids), pieces, whole, MAX_PENDING) == whole
    assert stream(factory(tools, sequential_ids), list(text), whole, MAX_PENDING) == whole


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_well_formed_calls_are_extracted_for_every_cut(name):
    call = hermes_call("f", {"n": 1}) if name == "hermes" else qwen_call("f", {"n": "1"}, wrapped=False)
    text = f"pre{call}post"
    whole = parse(name, text)
    assert whole.content == "prepost" and [c.name for c in whole.tool_calls] == ["f"]
    for cut in range(len(text) + 1):
        parser = PARSERS[name][0](TOOLS, sequential_ids)
        assert stream(parser, [text[:cut], text[cut:]], whole, MAX_PENDING) == whole
