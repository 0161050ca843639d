"""Client disconnects abort engine requests; 200 concurrent streams all complete; pre-bound sockets serve."""

import asyncio
import json
import socket

import httpx
import openai

from megatron.core.inference.coordinator import InferenceClient
from megatron.core.inference.server import ServerThread, bind_socket, build_app

from ..coordinator.cluster import running_cluster, wait_until
from ..coordinator.engine_double import HashEngine, expected_tokens
from .harness import TOKENIZER, openai_server, sample, scrape


def test_closing_a_stream_mid_generation_aborts_the_request_in_the_engine():
    engine = HashEngine(step_delay_s=0.005)
    with openai_server([engine]) as (server, coordinator):
        body = {"model": "megatron", "prompt": "long", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=10) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
        wait_until(lambda: list(engine.finished.values()) == ["abort"], "the abort to reach the engine")
        wait_until(lambda: not coordinator.router.routes, "routing state to clear")
        assert [load.pending for load in coordinator.router.engines.values()] == [0]
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_client_leaving_a_whole_request_aborts_it():
    engine = HashEngine(step_delay_s=0.005)
    with openai_server([engine]) as (server, coordinator):
        body = b'{"model": "megatron", "prompt": "long", "max_tokens": 4000}'
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_until(lambda: engine.tokens_generated > 0, "the request to be generating")
        # The client has left (the connection is closed) while its request generates.
        wait_until(lambda: list(engine.finished.values()) == ["abort"], "the abort to reach the engine")
        wait_until(lambda: not coordinator.router.routes, "routing state to clear")


def test_200_concurrent_streams_all_complete_with_their_tokens():
    engines = [HashEngine(), HashEngine()]
    with openai_server(engines) as (server, coordinator):

        async def one(client: httpx.AsyncClient, i: int):
            body = {
                "model": "megatron",
                "prompt": f"p{i}",
                "max_tokens": 8 + i % 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            text, usage = "", None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        text += "".join(choice["text"] for choice in chunk["choices"])
                        usage = chunk.get("usage") or usage
            return text, usage

        async def main():
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30) as client:
                return await asyncio.gather(*(one(client, i) for i in range(200)))

        results = asyncio.run(main())
        for i, (text, usage) in enumerate(results):
            count = 8 + i % 5
            assert text == TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize(f"p{i}"), count))
            assert usage["completion_tokens"] == count
        assert sum(len(engine.finished) for engine in engines) == 200
        # Both replicas served; how evenly depends on how fast each drains its load (the
        # least-load split itself is tested deterministically in the routing tests).
        assert all(engine.finished for engine in engines)
        assert httpx.get(server.url + "/health").status_code == 200
        wait_until(lambda: not coordinator.router.routes, "routing state to clear")


def test_serving_on_a_socket_the_caller_bound():
    with running_cluster([HashEngine()]) as coordinator:
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        app = build_app(InferenceClient(coordinator.address))
        with ServerThread(app, port=1, sock=sock) as server:  # the socket's port wins over `port`
            assert server.port == port
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            result = api.completions.create(model="megatron", prompt="sock", max_tokens=3)
            assert result.choices[0].text == TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize("sock"), 3))


def test_metrics_count_requests_tokens_queue_and_kv_use():
    with openai_server() as (server, coordinator):
        httpx.post(server.url + "/v1/completions", json={"model": "megatron", "prompt": "abc", "max_tokens": 4})
        httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "abc"})
        samples = scrape(server.url)
    assert sample(samples, "megatron_requests_total", endpoint="/v1/completions", status="200") == 1
    assert sample(samples, "megatron_requests_total", endpoint="/v1/completions", status="404") == 1
    assert (
        sample(samples, "megatron_prompt_tokens_total") == 3
        and sample(samples, "megatron_generation_tokens_total") == 4
    )
    assert sample(samples, "megatron_queue_depth") == 0
    assert sample(samples, "megatron_time_to_first_token_seconds_count") == 1
    assert sample(samples, "megatron_engine_kv_usage_fraction", engine="engine-0") is not None
