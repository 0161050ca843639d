"""Issue 19, item 3: liveness both ways, through real processes, ZeroMQ and HTTP.

An engine that falls silent (SIGSTOP) is dropped: its streaming request ends with one error
event, ``/health`` answers 503 while no engine is left and 200 once the engine is heard again.
A coordinator that falls silent is noticed by the HTTP server's client (its in-flight request
ends with one error, new ones get 503 at once, ``/health`` 503) and by the engine (which
aborts what it was running for it); both recover when it answers again. A request waiting for
an engine waits a bounded time (503), in a bounded queue (429 at once when full). A request
past the coordinator's deadline ends with one error (504, or one error event in its stream)
and is aborted at its engine, which keeps serving the others."""

import asyncio
import contextlib
import json
import os
import signal
import threading

import httpx

from megatron.core.inference import coordinator as control_plane
from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.server import ServerConfig, ServerThread
from tests.unit_tests.inference.coordinator.cluster import running_cluster, wait_until
from tests.unit_tests.inference.coordinator.engine_double import TOKENIZER, HashEngine, expected_tokens
from tests.unit_tests.inference.faults.serving_processes import STEP_DELAY_S, StreamedCompletion, launched

TIMEOUT_S = 1.0  # heartbeat and route timeouts of these tests
LONG = {"model": "megatron", "prompt": "long", "max_tokens": 4000}


def _server(address: str, keys) -> ServerThread:
    client = InferenceClient(address, keys=keys.for_role("client"), heartbeat_timeout_s=TIMEOUT_S)
    return ServerThread(client, tokenizer=TOKENIZER, config=ServerConfig())


def _assert_one_error_then_done(stream: StreamedCompletion, code: str) -> None:
    events = stream.rest()
    assert len(stream.errors) == 1 and stream.errors[0]["error"]["code"] == code, events[-3:]
    assert events[-1] == "data: [DONE]" and events[-2].startswith('data: {"error"')


def _long_stream(http: httpx.Client) -> StreamedCompletion:
    stream = StreamedCompletion(http, LONG).first()
    assert stream.response.status_code == 200 and json.loads(stream.events[0].removeprefix("data: "))["choices"]
    return stream


def _health(url: str) -> tuple[int, dict]:
    response = httpx.get(url + "/health", timeout=10)
    return response.status_code, response.json()


def _wait_for_health(url: str, status: int) -> dict:
    wait_until(lambda: _health(url)[0] == status, f"/health to answer {status}", timeout_s=15)
    return _health(url)[1]


def _completion(url: str, prompt: str) -> httpx.Response:
    body = {"model": "megatron", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def _expected(prompt: str) -> str:
    return TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize(prompt), 3))


@contextlib.contextmanager
def _stopped(pid: int):
    """``stop()`` stops process ``pid`` (SIGSTOP); it continues (SIGCONT) when the block ends."""
    try:
        yield lambda: os.kill(pid, signal.SIGSTOP)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_silent_engine_ends_its_stream_with_one_error_and_health_follows_the_engines(tmp_path):
    keys = control_plane.ControlPlaneKeys.generate()
    engine_keys = keys.for_role("engine").save(str(tmp_path / "engine.json"))
    coordinator = InferenceCoordinator(keys=keys, heartbeat_timeout_s=TIMEOUT_S, route_timeout_s=TIMEOUT_S).start()
    try:
        timeout = ["--heartbeat-timeout-s", str(TIMEOUT_S)]
        keys_env = {control_plane.auth.KEYS_ENV: engine_keys}
        with launched("engine", coordinator.address, *timeout, env=keys_env) as engine:
            engine.wait_for("Engine up")
            wait_until(lambda: len(coordinator.engine_ids) == 1, "the engine to register")
            with _server(coordinator.address, keys) as server:
                assert _health(server.url) == (200, {"status": "ok"})
                with httpx.Client(base_url=server.url, timeout=30) as http, _stopped(engine.process.pid) as stop:
                    stream = _long_stream(http)
                    stop()
                    _assert_one_error_then_done(stream, "unavailable")  # EngineLostError
                    health = _wait_for_health(server.url, 503)
                    assert health["error"]["message"] == "no engine replica is registered with the coordinator"
                    refused = _completion(server.url, "meanwhile")  # waits TIMEOUT_S for an engine, then 503
                    assert refused.status_code == 503 and "no engine replica registered" in refused.text
                assert _wait_for_health(server.url, 200) == {"status": "ok"}  # heard again: registered again
                back = _completion(server.url, "back")
                assert back.status_code == 200 and back.json()["choices"][0]["text"] == _expected("back")
    finally:
        coordinator.stop()


def test_a_silent_coordinator_fails_in_flight_requests_at_client_and_engine_until_it_answers(tmp_path):
    keys = control_plane.ControlPlaneKeys.generate()
    coordinator_keys = keys.save(str(tmp_path / "coordinator.json"))
    timeout = ["--heartbeat-timeout-s", str(TIMEOUT_S)]
    with launched("coordinator", *timeout, env={control_plane.auth.KEYS_ENV: coordinator_keys}) as coordinator:
        address = coordinator.wait_for(r"Coordinator on (tcp://\S+)").group(1)
        engine = HashEngine(step_delay_s=STEP_DELAY_S)
        endpoint = EngineEndpoint(engine, address, keys=keys.for_role("engine"), heartbeat_timeout_s=TIMEOUT_S)
        endpoint_thread = threading.Thread(target=endpoint.run, daemon=True)
        endpoint_thread.start()
        try:
            with _server(address, keys) as server:
                _wait_for_health(server.url, 200)
                with httpx.Client(base_url=server.url, timeout=30) as http, _stopped(coordinator.process.pid) as stop:
                    stream = _long_stream(http)
                    stop()
                    _assert_one_error_then_done(stream, "unavailable")  # CoordinatorLostError
                    health = _wait_for_health(server.url, 503)
                    assert health["error"]["message"] == f"the coordinator at {address} is not answering"
                    refused = _completion(server.url, "meanwhile")
                    assert refused.status_code == 503 and "is not answering" in refused.text
                    wait_until(lambda: list(engine.finished.values()) == ["abort"], "the engine to abort")
                assert _wait_for_health(server.url, 200) == {"status": "ok"}
                back = _completion(server.url, "back")
                assert back.status_code == 200 and back.json()["choices"][0]["text"] == _expected("back")
        finally:
            endpoint.request_stop()
            endpoint_thread.join(10)


def test_a_request_waits_for_an_engine_a_bounded_time_in_a_bounded_queue():
    coordinator = InferenceCoordinator(route_timeout_s=TIMEOUT_S, max_waiting_requests=2).start()
    try:
        with _server(coordinator.address, coordinator.keys) as server:
            status, body = _health(server.url)
            assert status == 503 and body["error"]["message"] == "no engine replica is registered with the coordinator"

            async def main():
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                    body = {"model": "megatron", "prompt": "x", "max_tokens": 3}
                    waiting = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(2)]
                    await asyncio.to_thread(wait_until, lambda: coordinator.stats()["unrouted"] == 2, "two to wait")
                    full = await http.post("/v1/completions", json=body)
                    return full, await asyncio.gather(*waiting)

            full, waited = asyncio.run(main())
            assert full.status_code == 429 and full.json()["error"]["code"] == "overloaded"
            assert "2 requests already wait for one" in full.json()["error"]["message"]
            for response in waited:
                assert response.status_code == 503
                assert response.json()["error"]["message"] == f"no engine replica registered within {TIMEOUT_S}s"
            assert coordinator.stats()["unrouted"] == 0
    finally:
        coordinator.stop()


def test_a_request_past_its_deadline_ends_with_one_error_and_is_aborted_at_its_engine():
    engine = HashEngine(step_delay_s=STEP_DELAY_S)
    with running_cluster([engine], request_timeout_s=TIMEOUT_S) as coordinator:
        with _server(coordinator.address, coordinator.keys) as server:
            with httpx.Client(base_url=server.url, timeout=30) as http:
                stream = _long_stream(http)
                _assert_one_error_then_done(stream, "timeout")
                plain = http.post("/v1/completions", json=LONG)
                quick = _completion(server.url, "quick")  # well within the deadline
        assert plain.status_code == 504 and plain.json()["error"]["code"] == "timeout"
        assert plain.json()["error"]["message"] == f"the request did not finish within {TIMEOUT_S}s"
        assert quick.status_code == 200 and quick.json()["choices"][0]["text"] == _expected("quick")
        wait_until(lambda: sorted(engine.finished.values()) == ["abort", "abort", "length"], "the engine to abort")
        assert coordinator.router.routes == {} and coordinator.stats()["in_flight"] == 0
