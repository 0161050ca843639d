"""Bad requests get OpenAI error bodies with the right status; requests in flight are unaffected."""

import json
import threading

import httpx
import pytest

from ..coordinator.engine_double import HashEngine, expected_tokens
from .harness import TOKENIZER, app_server, openai_server, scripted_output


@pytest.fixture(scope="module")
def server():
    engine = HashEngine(script=scripted_output, step_delay_s=0.002, max_sequence_length=64)
    with openai_server([engine], max_prompt_tokens=100, max_request_bytes=4096) as (server, coordinator):
        yield server, coordinator


def post(server, path, **kwargs):
    return httpx.post(server[0].url + path, timeout=10, **kwargs)


def error_of(response, status):
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    return response.json()["error"]


def test_invalid_sampling_values_are_400_naming_the_field(server):
    error = error_of(post(server, "/v1/completions", json={"model": "megatron", "prompt": "a", "temperature": -1}), 400)
    assert error["param"] == "temperature" and error["message"].startswith("temperature: Input should be greater")
    error = error_of(
        post(
            server,
            "/v1/chat/completions",
            json={"model": "megatron", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        ),
        400,
    )
    assert error["message"] == "top_logprobs=2 needs logprobs=True" and error["param"] == "top_logprobs"
    error = error_of(post(server, "/v1/completions", json={"model": "megatron", "prompt": "a", "stop": [""]}), 400)
    assert error["message"].startswith("stop must be a non-empty string or a list of non-empty strings")


def test_schema_errors_are_400_not_422(server):
    error = error_of(post(server, "/v1/completions", json={"model": "megatron"}), 400)
    assert error["message"] == "prompt: Field required" and error["param"] == "prompt"
    error = error_of(post(server, "/v1/completions", json={"model": "megatron", "prompt": "a", "n": "many"}), 400)
    assert error["param"] == "n"


def test_malformed_json_is_400(server):
    error = error_of(
        post(
            server,
            "/v1/completions",
            content=b'{"model": "megatron", "prompt":',
            headers={"content-type": "application/json"},
        ),
        400,
    )
    assert error["message"].startswith("request body is not valid JSON") and error["code"] == "invalid_json"


def test_oversize_body_is_413_and_overlong_prompt_is_400_context_length_exceeded(server):
    error = error_of(post(server, "/v1/completions", json={"model": "megatron", "prompt": "x" * 5000}), 413)
    assert error["message"] == "request body is larger than 4096 bytes; send a smaller request"
    error = error_of(post(server, "/v1/completions", json={"model": "megatron", "prompt": "x" * 101}), 400)
    assert error["message"] == "prompt has 101 tokens but this server accepts at most 100; shorten it"
    assert error["code"] == "context_length_exceeded"
    # Over the engine's own limit (64) but under the server's: the engine's typed error, as 400, streamed or not.
    for stream in (False, True):
        error = error_of(
            post(server, "/v1/completions", json={"model": "megatron", "prompt": "x" * 80, "stream": stream}), 400
        )
        assert error["message"].startswith("prompt has 80 tokens but the maximum sequence length is 64")
        assert error["code"] == "context_length_exceeded"


def test_unknown_model_is_404_and_bad_token_ids_are_400(server):
    error = error_of(post(server, "/v1/completions", json={"model": "gpt-9", "prompt": "a"}), 404)
    assert (
        error["code"] == "model_not_found"
        and error["message"] == "model 'gpt-9' does not exist; this server serves 'megatron'"
    )
    error = error_of(post(server, "/v1/completions", json={"model": "megatron", "prompt": [1, 999]}), 400)
    assert error["message"] == "prompt holds token ids [999] outside 0..258"
    error_of(httpx.get(server[0].url + "/v1/nothing-here"), 404)


def test_api_key_is_required_when_set(server):
    with app_server(server[1], api_key="sesame") as guarded:
        body = {"model": "megatron", "prompt": "a", "max_tokens": 1}
        error = error_of(httpx.post(guarded.url + "/v1/completions", json=body), 401)
        assert error["type"] == "authentication_error"
        error_of(httpx.post(guarded.url + "/v1/completions", json=body, headers={"authorization": "Bearer nope"}), 401)
        ok = httpx.post(guarded.url + "/v1/completions", json=body, headers={"authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert httpx.get(guarded.url + "/health").status_code == 200


def test_a_stream_in_flight_is_unaffected_by_bad_requests(server):
    collected = []

    def stream():
        body = {"model": "megatron", "prompt": "steady", "max_tokens": 58, "stream": True}  # 64 tokens in all
        with httpx.stream("POST", server[0].url + "/v1/completions", json=body, timeout=30) as response:
            collected.extend(response.iter_lines())

    thread = threading.Thread(target=stream)
    thread.start()
    for bad in ({"model": "megatron", "prompt": "a", "top_p": 0}, {"model": "megatron", "prompt": "x" * 80}, {}):
        assert post(server, "/v1/completions", json=bad).status_code == 400
    post(server, "/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    thread.join(30)

    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in collected if line.startswith("data: {"))
    assert text == TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize("steady"), 58))
    assert [line for line in collected if line][-1] == "data: [DONE]"
