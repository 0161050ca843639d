"""Item 7: valid JSON the server cannot use is a 400 naming the field, never a 500, and leaves
nothing in flight: a lone surrogate ("\\ud800", which JSON allows and UTF-8 cannot hold) in a
prompt, a message or a tool, and integers >= 2**64 for max_tokens, max_completion_tokens or top_k
(which msgpack cannot carry to the coordinator)."""

import asyncio

import httpx
import pytest

from megatron.core.inference.coordinator import InferenceClient
from megatron.core.inference.coordinator.messages import ProtocolError
from megatron.core.inference.sampling import SamplingParams

from ..coordinator.cluster import wait_until
from ..coordinator.engine_double import HashEngine, expected_tokens
from ..server.harness import TOKENIZER, openai_server

CHAT = '"model": "megatron", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]'
SURROGATE_BODIES = {
    "prompt": ("/v1/completions", r'{"model": "megatron", "prompt": "a\ud800b"}'),
    "prompt (a list)": ("/v1/completions", r'{"model": "megatron", "prompt": ["ok", "\udfff"]}'),
    "messages.0.content": (
        "/v1/chat/completions",
        r'{"model": "megatron", "messages": [{"role": "user", "content": "\ud800"}]}',
    ),
    "messages.0.content.0.text": (
        "/v1/chat/completions",
        r'{"model": "megatron", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
    ),
    "tools.0.function.description": (
        "/v1/chat/completions",
        "{" + CHAT + r', "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}',
    ),
    "tool_choice.function.name": (
        "/v1/chat/completions",
        "{" + CHAT + r', "tool_choice": {"type": "function", "function": {"name": "\ud800"}}}',
    ),
    "tools.0.function.parameters": (
        "/v1/chat/completions",
        "{" + CHAT + r', "tools": [{"type": "function", "function": {"name": "f", "parameters": {"\ud800": 1}}}]}',
    ),
}
HUGE = 2**64
HUGE_INTS = {
    "max_tokens": ("/v1/completions", {"model": "megatron", "prompt": "a", "max_tokens": HUGE}),
    "top_k": ("/v1/completions", {"model": "megatron", "prompt": "a", "top_k": HUGE, "stream": True}),
    "max_completion_tokens": (
        "/v1/chat/completions",
        {"model": "megatron", "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": HUGE},
    ),
}


@pytest.fixture(scope="module")
def served():
    with openai_server([HashEngine()]) as (server, coordinator):
        yield server, coordinator


def _error(response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error


def _nothing_in_flight(server, coordinator) -> None:
    assert server.app.state.service.client.in_flight == 0
    wait_until(lambda: not coordinator.router.routes, "routing state to clear")


@pytest.mark.parametrize("case", SURROGATE_BODIES)
def test_a_lone_surrogate_is_400_naming_the_field(served, case):
    server, coordinator = served
    path, body = SURROGATE_BODIES[case]
    param = case.split()[0]
    response = httpx.post(
        server.url + path, content=body.encode("ascii"), headers={"content-type": "application/json"}, timeout=10
    )
    error = _error(response, param)
    assert "lone surrogate U+D" in error["message"] and error["message"].startswith(f"{param}: ")
    _nothing_in_flight(server, coordinator)


@pytest.mark.parametrize("param", HUGE_INTS)
def test_an_integer_msgpack_cannot_carry_is_400_and_leaks_nothing(served, param):
    server, coordinator = served
    path, body = HUGE_INTS[param]
    for _ in range(3):  # each leaked one in-flight entry before
        error = _error(httpx.post(server.url + path, json=body, timeout=10), param)
        assert error["message"] == f"{param}: Input should be less than or equal to {2**63 - 1}"
    _nothing_in_flight(server, coordinator)
    # The server keeps serving.
    ok = httpx.post(server.url + "/v1/completions", json={"model": "megatron", "prompt": "ok", "max_tokens": 3})
    assert ok.json()["choices"][0]["text"] == TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize("ok"), 3))


def test_the_client_keeps_no_handle_for_a_request_it_could_not_send(served):
    server, coordinator = served

    async def scenario():
        async with InferenceClient(coordinator.address) as client:
            with pytest.raises(ProtocolError, match="msgpack cannot encode"):
                await client.submit([1, 2], SamplingParams(max_tokens=HUGE), request_id="huge")
            assert client.in_flight == 0
            # The id is free again: nothing of the failed submit was kept.
            return await (await client.submit([1, 2], SamplingParams(max_tokens=2), request_id="huge")).result()

    assert asyncio.run(scenario())["finish_reason"] == "length"
