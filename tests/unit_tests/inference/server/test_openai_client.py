"""The real `openai` client against a running server: completions and chat, whole and streamed."""

import json

import openai
import pytest

from megatron.core.inference.server.chat_template import default_chat_prompt

from ..coordinator.engine_double import expected_tokens, token_log_prob, top_log_probs
from .harness import TOKENIZER, app_server, openai_server


@pytest.fixture(scope="module")
def server():
    with openai_server() as (server, coordinator):
        yield server, coordinator


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def expected_text(prompt: str, count: int) -> str:
    return TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize(prompt), count))


def chat_prompt(content: str) -> str:
    return default_chat_prompt([{"role": "user", "content": content}])


def test_models_lists_the_served_model(api):
    assert [m.id for m in api.models.list().data] == ["megatron"]


def test_completion_text_usage_and_length_finish(api):
    result = api.completions.create(model="megatron", prompt="hello", max_tokens=7, temperature=0)
    assert result.choices[0].text == expected_text("hello", 7)
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (5, 7, 12)


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(api):
    chunks = list(
        api.completions.create(
            model="megatron", prompt="hello", max_tokens=7, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text("hello", 7)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_stop_sequence_cuts_the_text_and_finishes_with_stop(api):
    full = expected_text("stop me", 40)
    stop = full[5:7]
    result = api.completions.create(model="megatron", prompt="stop me", max_tokens=40, stop=[stop, "never!"])
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model="megatron", prompt="stop me", max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_eos_finishes_with_stop_and_is_counted(api):
    result = api.completions.create(model="megatron", prompt="[eos]", max_tokens=20)
    assert result.choices[0].text == "bye" and result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens == 4  # "bye" and the EOS token


def test_completion_logprobs_echo_and_n(api):
    result = api.completions.create(model="megatron", prompt="abc", max_tokens=3, logprobs=2, echo=True, n=2, seed=5)
    assert len(result.choices) == 2 and result.usage.completion_tokens == 6
    choice = result.choices[0]
    generated = expected_tokens(TOKENIZER.tokenize("abc"), 3)
    assert choice.text == "abc" + TOKENIZER.detokenize(generated)
    assert choice.logprobs.tokens == ["a", "b", "c"] + [chr(t) for t in generated]
    assert choice.logprobs.token_logprobs == [None, -0.5, -0.5] + [token_log_prob(t) for t in generated]
    assert choice.logprobs.text_offset == list(range(6))
    # Each generated position lists the engine's 2 most likely tokens.
    assert choice.logprobs.top_logprobs[3:] == [{chr(i): lp for i, lp in top_log_probs(t, 2)} for t in generated]


def test_chat_completion_whole_and_streamed(api):
    messages = [{"role": "user", "content": "hi there"}]
    expected = expected_text(chat_prompt("hi there"), 6)
    result = api.chat.completions.create(model="megatron", messages=messages, max_completion_tokens=6)
    assert result.choices[0].message.content == expected
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(TOKENIZER.tokenize(chat_prompt("hi there")))
    chunks = list(
        api.chat.completions.create(
            model="megatron", messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_logprobs_with_top_logprobs(api):
    result = api.chat.completions.create(
        model="megatron", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    generated = expected_tokens(TOKENIZER.tokenize(chat_prompt("x")), 3)
    content = result.choices[0].logprobs.content
    assert [entry.token for entry in content] == [chr(t) for t in generated]
    assert [entry.logprob for entry in content] == [token_log_prob(t) for t in generated]
    assert [[(top.token, top.logprob) for top in entry.top_logprobs] for entry in content] == [
        [(chr(i), lp) for i, lp in top_log_probs(t, 2)] for t in generated
    ]


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def test_tool_calls_whole_and_streamed(api):
    messages = [{"role": "user", "content": "[tool] weather in Paris?"}]
    result = api.chat.completions.create(model="megatron", messages=messages, tools=[WEATHER_TOOL], max_tokens=200)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content == "<think>need weather</think>"  # no reasoning parser on this server
    chunks = list(api.chat.completions.create(model="megatron", messages=messages, tools=[WEATHER_TOOL], stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_content_beside_content(server):
    with app_server(server[1], reasoning_parser="deepseek_r1") as reasoning_server:
        api = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "[think] 2+2?"}]
        message = api.chat.completions.create(model="megatron", messages=messages).choices[0].message
        assert (message.reasoning_content, message.content) == ("two plus two", "four")
        chunks = list(api.chat.completions.create(model="megatron", messages=messages, stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "two plus two"
        assert "".join(d.content or "" for d in deltas) == "four"


def test_requests_leave_no_routing_state(server, api):
    api.completions.create(model="megatron", prompt="done", max_tokens=2)
    coordinator = server[1]
    assert coordinator.router.routes == {}
    coordinator.router.check_invariants()
