"""Structured output through the real ``openai`` client, the server and the real engine (tiny
random GPT, byte-level tokenizer): the grammar alone makes the outputs valid."""

import json

import jsonschema
import openai
import pytest

from megatron.core.inference.engines import DynamicInferenceEngine
from tests.unit_tests.inference.engines.common import gpt_model
from tests.unit_tests.transformer.single_rank import on_single_rank

from .harness import TOKENIZER, openai_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
MESSAGES = [{"role": "user", "content": "describe someone"}]


def _engine(pg) -> DynamicInferenceEngine:
    # Room for a chat prompt that lists two tools (about 500 bytes).
    model = gpt_model(pg, vocab_size=TOKENIZER.vocab_size, max_sequence_length=1024)
    return DynamicInferenceEngine(
        model,
        max_tokens_per_step=1024,
        block_size=16,
        num_blocks=160,
        max_requests=4,
        max_sequence_length=1024,
        tokenizer=TOKENIZER,
        pg_collection=pg,
    )


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@on_single_rank
def test_json_schema_outputs_parse_and_validate_whole_streamed_and_with_n_2(pg):
    with openai_server([_engine(pg)]) as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        fmt = _json_schema_format(PERSON)
        whole = api.chat.completions.create(
            model="megatron", messages=MESSAGES, max_tokens=150, temperature=1.0, seed=5, n=2, response_format=fmt
        )
        greedy = api.chat.completions.create(
            model="megatron", messages=MESSAGES, max_tokens=150, temperature=0, response_format=fmt
        )
        stream = api.chat.completions.create(
            model="megatron",
            messages=MESSAGES,
            max_tokens=150,
            temperature=1.0,
            seed=6,
            n=2,
            response_format=fmt,
            stream=True,
        )
        streamed = {0: "", 1: ""}
        reasons = {}
        for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
                if choice.finish_reason is not None:
                    reasons[choice.index] = choice.finish_reason
    texts = [c.message.content for c in whole.choices] + [greedy.choices[0].message.content] + list(streamed.values())
    assert [c.finish_reason for c in whole.choices + greedy.choices] == ["stop"] * 3 and reasons == {
        0: "stop",
        1: "stop",
    }
    assert len(set(texts)) > 1  # sampled outputs differ: the grammar constrains, it does not script
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


@on_single_rank
def test_json_object_gives_a_json_object(pg):
    with openai_server([_engine(pg)]) as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        result = api.chat.completions.create(
            model="megatron",
            messages=MESSAGES,
            max_tokens=200,
            temperature=1.0,
            seed=1,
            n=2,
            response_format={"type": "json_object"},
        )
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


@on_single_rank
def test_named_and_required_tool_choice_call_a_tool_with_schema_valid_arguments(pg):
    with openai_server([_engine(pg)]) as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        named = api.chat.completions.create(
            model="megatron",
            messages=MESSAGES,
            max_tokens=150,
            temperature=1.0,
            seed=2,
            n=2,
            tools=[TIME, WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        required = api.chat.completions.create(
            model="megatron",
            messages=MESSAGES,
            max_tokens=150,
            temperature=1.0,
            seed=3,
            tools=[TIME, WEATHER],
            tool_choice="required",
            stream=True,
        )
        calls = {}
        for chunk in required:
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        function = choice.message.tool_calls[0].function
        assert function.name == "get_weather"
        jsonschema.validate(json.loads(function.arguments), WEATHER["function"]["parameters"])
    (call,) = calls.values()
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


@on_single_rank
def test_a_schema_that_does_not_compile_is_one_400_and_other_requests_are_served(pg):
    with openai_server([_engine(pg)]) as (server, coordinator):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as error:
            api.chat.completions.create(
                model="megatron",
                messages=MESSAGES,
                max_tokens=20,
                response_format=_json_schema_format({"type": "object", "properties": {"a": {"$ref": "#/missing"}}}),
            )
        after = api.chat.completions.create(
            model="megatron",
            messages=MESSAGES,
            max_tokens=150,
            temperature=0,
            response_format=_json_schema_format(PERSON),
        )
        assert coordinator.router.routes == {}
    assert error.value.body == {
        "message": "cannot constrain the output to the JSON schema: Cannot find field 'missing' in #/missing",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_request",
    }
    jsonschema.validate(json.loads(after.choices[0].message.content), PERSON)


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt():
    # The engine double's output is a hash of the prompt: equal outputs, equal prompts.
    with openai_server() as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        without = api.chat.completions.create(model="megatron", messages=MESSAGES, max_tokens=8)
        none = api.chat.completions.create(
            model="megatron", messages=MESSAGES, max_tokens=8, tools=[WEATHER], tool_choice="none"
        )
        auto = api.chat.completions.create(model="megatron", messages=MESSAGES, max_tokens=8, tools=[WEATHER])
    assert none.choices[0].message.content == without.choices[0].message.content
    assert auto.choices[0].message.content != without.choices[0].message.content


@pytest.mark.parametrize(
    "config, request_fields, message",
    [
        (
            {"tool_call_parser": "qwen3_coder"},
            {"tools": [WEATHER], "tool_choice": "required"},
            "tool_choice forcing a tool call needs a server started with --tool-call-parser one of ['hermes']; "
            "this one has 'qwen3_coder'",
        ),
        (
            {},
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format 'json_object' and tool_choice forcing a tool call cannot both hold; send one",
        ),
        (
            {},
            {"response_format": {"type": "json_schema"}},
            'response_format of type "json_schema" needs a json_schema object with a schema',
        ),
    ],
    ids=["tool-parser-without-grammar", "json-and-forced-tool", "json-schema-without-schema"],
)
def test_grammars_the_server_cannot_build_are_a_400_naming_the_field(config, request_fields, message):
    with openai_server(**config) as (server, coordinator):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as error:
            api.chat.completions.create(model="megatron", messages=MESSAGES, max_tokens=8, **request_fields)
        assert coordinator.router.routes == {}
    assert error.value.body["message"] == message
    assert error.value.body["param"] in ("tool_choice", "response_format")
