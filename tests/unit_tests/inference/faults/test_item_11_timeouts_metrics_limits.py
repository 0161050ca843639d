"""Item 11: half-sent requests do not hold connections (a deadline for the request head closes the
connection, one for the body answers 408 and closes it); /metrics counts 5xx (also from errors
that escape the app) and abandoned requests; the stop limits are on the number of stop strings
and, separately, on each string's length; over-long prompts are 400 ``context_length_exceeded``
(as OpenAI and vLLM answer), not 413."""

import json
import socket

import httpx
import pytest

from megatron.core.inference.server import launcher

from ..coordinator.cluster import wait_until
from ..coordinator.engine_double import HashEngine, expected_tokens
from ..server.harness import TOKENIZER, openai_server, sample, scrape

HALF_SENT = 100  # of each kind


@pytest.fixture(scope="module")
def served():
    engine = HashEngine(step_delay_s=0.002, max_sequence_length=64)
    with openai_server([engine], max_prompt_tokens=100) as (server, coordinator):
        yield server, coordinator, engine


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)  # a hang guard, not a measurement
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def test_half_sent_heads_and_bodies_are_cut_off():
    with openai_server(header_timeout_s=0.5, body_timeout_s=0.5) as (server, coordinator):
        _cut_off_half_sent_requests(server)


def test_megatron_serve_flags_set_the_deadlines():
    argv = ["--load", "ckpt", "--http-header-timeout", "0.5", "--http-body-timeout", "2"]
    configured = launcher.server_config(launcher.parse_args(argv))
    default = launcher.server_config(launcher.parse_args(["--load", "ckpt"]))
    assert (configured.header_timeout_s, configured.body_timeout_s) == (0.5, 2.0)
    assert (default.header_timeout_s, default.body_timeout_s) == (10.0, 30.0)


def _cut_off_half_sent_requests(server) -> None:
    heads, bodies = [], []
    for _ in range(HALF_SENT):
        heads.append(_connect(server))
        heads[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-")
        bodies.append(_connect(server))
        bodies[-1].sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model": "megatron", '
        )
    for sock in heads:
        with sock:
            assert _read_until_closed(sock) == b""  # closed by the server, nothing answered
    for sock in bodies:
        with sock:
            head, _, body = _read_until_closed(sock).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
            assert json.loads(body)["error"]["code"] == "request_timeout"
    # A well-behaved client on a keep-alive connection is served as before.
    with httpx.Client(base_url=server.url) as client:
        for _ in range(2):
            response = client.post("/v1/completions", json={"model": "megatron", "prompt": "ok", "max_tokens": 2})
            assert response.json()["choices"][0]["text"] == TOKENIZER.detokenize(
                expected_tokens(TOKENIZER.tokenize("ok"), 2)
            )
    samples = scrape(server.url)
    assert sample(samples, "megatron_requests_total", endpoint="/v1/completions", status="408") == HALF_SENT


def test_metrics_count_5xx_and_abandoned_requests(served):
    server, coordinator, engine = served

    @server.app.get("/v1/fail")
    async def fail():
        raise RuntimeError("an error no handler turns into a response")

    assert httpx.get(server.url + "/v1/fail").status_code == 500
    body = {"model": "megatron", "prompt": "leave", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=10) as response:
        assert next(response.iter_lines()).startswith("data: {")  # then leave mid-stream
    wait_until(lambda: "abort" in engine.finished.values(), "the abort to reach the engine")
    wait_until(lambda: not coordinator.router.routes, "routing state to clear")
    samples = scrape(server.url)
    assert sample(samples, "megatron_requests_total", endpoint="other", status="500") == 1
    assert sample(samples, "megatron_requests_by_status_class_total", endpoint="other", status_class="5xx") == 1
    assert sample(samples, "megatron_requests_abandoned_total", endpoint="/v1/completions") == 1


def test_stop_limits_count_strings_and_bound_each_string_separately(served):
    server = served[0]
    prompt = "stop me"
    text = TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize(prompt), 40))
    long_stop = text[10:30]  # one stop string of 20 characters
    body = {"model": "megatron", "prompt": prompt, "max_tokens": 40, "stop": long_stop}
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0] == {
        "index": 0,
        "text": text[:10],
        "logprobs": None,
        "finish_reason": "stop",
    }
    for stop, message in (
        (["s"] * 17, "stop: holds 17 stop sequences; at most 16 are accepted"),
        ("x" * 257, "stop: holds a stop sequence of 257 characters; each may have at most 256"),
        (["ok", "x" * 300], "stop: holds a stop sequence of 300 characters; each may have at most 256"),
    ):
        response = httpx.post(server.url + "/v1/completions", json={**body, "stop": stop})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == message and response.json()["error"]["param"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_over_long_prompts_are_400_context_length_exceeded(served, stream):
    server = served[0]
    for prompt, message in (
        ("x" * 101, "prompt has 101 tokens but this server accepts at most 100; shorten it"),  # the server's cap
        ("x" * 80, "prompt has 80 tokens but the maximum sequence length is 64"),  # the engine's limit
    ):
        body = {"model": "megatron", "prompt": prompt, "stream": stream}
        response = httpx.post(server.url + "/v1/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["message"].startswith(message)
