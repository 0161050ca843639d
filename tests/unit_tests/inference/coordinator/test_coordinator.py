"""Coordinator + engine endpoints (threads) + asyncio client, against the deterministic engine double."""

import asyncio
import re

import pytest

from megatron.core.inference.contexts.errors import PromptTooLongError
from megatron.core.inference.coordinator import (
    ClientStateError,
    CoordinatorConfigError,
    DuplicateRequestIdError,
    EngineLostError,
    InferenceClient,
    InferenceCoordinator,
)
from megatron.core.inference.coordinator.messages import MessageKind, encode, error_output
from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.server import launcher

from .cluster import (
    async_wait_until,
    peer_socket,
    receive_command,
    run_with_client,
    running_cluster,
    serving,
    wait_until,
)
from .engine_double import HashEngine, expected_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def assert_no_routing_state(coordinator):
    wait_until(lambda: not coordinator.router.routes, "routing entries to clear")
    coordinator.router.check_invariants()
    assert [load.pending for load in coordinator.router.engines.values()] == [0] * len(coordinator.router.engines)


async def collect(handle):
    return [output async for output in handle]


def test_streamed_tokens_match_the_engine_and_end_with_one_terminal_output():
    with running_cluster([HashEngine()]) as coordinator:

        async def scenario(client):
            handles = [await client.submit([i, i + 1], GREEDY, request_id=f"r{i}") for i in range(3)]
            return [await collect(h) for h in handles], [await h.result() for h in handles]

        streams, results = run_with_client(coordinator, scenario)
        for i, (stream, result) in enumerate(zip(streams, results, strict=True)):
            assert [t for out in stream for t in out["new_token_ids"]] == expected_tokens([i, i + 1], 6)
            assert [out["finished"] for out in stream] == [False] * 5 + [True]
            assert result is stream[-1] and result["finish_reason"] == "length"
            assert (result["prompt_tokens"], result["generated_tokens"]) == (2, 6)
        assert_no_routing_state(coordinator)


def test_two_replicas_share_the_load():
    """Least-pending routing: 20 requests submitted while both engines hold theirs (paused, so
    none finishes and frees a place early, as one could on a slow machine) split 10/10."""
    engines = [HashEngine(step_delay_s=0.002), HashEngine(step_delay_s=0.002)]
    for engine in engines:
        engine.pause()
    with running_cluster(engines) as coordinator:

        async def scenario(client):
            handles = [await client.submit([i], GREEDY) for i in range(20)]
            await async_wait_until(lambda: sum(len(e.requests) for e in engines) == 20, "every request at an engine")
            for engine in engines:
                engine.resume()
            return [await h.result() for h in handles]

        results = run_with_client(coordinator, scenario)
        assert all(r["finish_reason"] == "length" for r in results)
        assert [len(engine.finished) for engine in engines] == [10, 10]
        assert_no_routing_state(coordinator)


def test_aborts_end_waiting_active_and_paused_requests():
    engine = HashEngine(max_active=2, step_delay_s=0.005)
    with running_cluster([engine]) as coordinator:

        async def scenario(client):
            long = SamplingParams(temperature=0.0, max_tokens=4000)
            handles = {
                name: await client.submit([1], long, request_id=name) for name in ("active", "paused", "waiting")
            }
            await async_wait_until(
                lambda: engine.state_of("paused") == "active" and engine.state_of("waiting") == "waiting",
                "two requests to be active and the third to reach the engine",
            )
            engine.park("paused")
            assert [engine.state_of(n) for n in handles] == ["active", "paused", "waiting"]
            for handle in handles.values():
                handle.abort()
            return {name: await h.result() for name, h in handles.items()}

        results = run_with_client(coordinator, scenario)
        assert {name: r["finish_reason"] for name, r in results.items()} == dict.fromkeys(results, "abort")
        assert engine.finished == dict.fromkeys(results, "abort")  # the abort reached the engine
        assert_no_routing_state(coordinator)


def test_pause_stops_progress_abort_still_ends_a_request_and_resume_continues():
    engine = HashEngine(step_delay_s=0.002)
    with running_cluster([engine]) as coordinator:

        async def scenario(client):
            await client.control("pause")
            await async_wait_until(lambda: engine.paused, "the engine to pause")
            kept = await client.submit([5], GREEDY)
            dropped = await client.submit([6], GREEDY)
            await asyncio.sleep(0.1)
            assert kept._queue.empty() and not kept.done
            dropped.abort()
            dropped_result = await dropped.result()
            assert not kept.done
            await client.control("resume")
            return await collect(kept), dropped_result

        kept_stream, dropped_result = run_with_client(coordinator, scenario)
        assert dropped_result["finish_reason"] == "abort"
        assert [t for out in kept_stream for t in out["new_token_ids"]] == expected_tokens([5], 6)
        assert_no_routing_state(coordinator)


def test_stop_gives_in_flight_requests_a_terminal_reply_and_engines_leave():
    engine = HashEngine(step_delay_s=0.002)
    with running_cluster([engine]) as coordinator:

        async def scenario(client):
            handle = await client.submit([1], SamplingParams(max_tokens=4000))
            await async_wait_until(lambda: engine.steps > 2, "generation to start")
            await client.control("stop")
            return await handle.result()

        assert run_with_client(coordinator, scenario)["finish_reason"] == "abort"
        wait_until(lambda: not coordinator.router.engines, "the engine to deregister")
        assert coordinator.router.routes == {}


def test_requests_wait_for_an_engine_and_can_be_aborted_meanwhile():
    coordinator = InferenceCoordinator().start()
    try:

        async def scenario(client):
            queued = await client.submit([3], GREEDY)
            dropped = await client.submit([4], GREEDY)
            client.abort(dropped.request_id)
            assert (await dropped.result())["finish_reason"] == "abort"
            with serving(coordinator, [HashEngine()]):
                return await collect(queued)

        stream = run_with_client(coordinator, scenario)
        assert [t for out in stream for t in out["new_token_ids"]] == expected_tokens([3], 6)
    finally:
        coordinator.stop()


def test_admission_errors_come_back_typed_and_the_engine_keeps_serving():
    with running_cluster([HashEngine(max_sequence_length=8)]) as coordinator:

        async def scenario(client):
            bad = await client.submit(list(range(9)), GREEDY)
            good = await client.submit([1], GREEDY)
            return await bad.result(), await good.result()

        bad, good = run_with_client(coordinator, scenario)
        assert bad["finish_reason"] == "error"
        assert InferenceRequestError.from_dict(bad["error"]) == PromptTooLongError(
            prompt_length=9, max_sequence_length=8
        )
        assert good["finish_reason"] == "length"
        assert_no_routing_state(coordinator)


def test_a_duplicate_id_from_another_client_is_refused_without_touching_the_first():
    with running_cluster([HashEngine(step_delay_s=0.002)]) as coordinator:

        async def scenario(client):
            first = await client.submit([1], SamplingParams(temperature=0.0, max_tokens=30), request_id="same")
            async with InferenceClient(coordinator.address) as other:
                duplicate = await (await other.submit([2], GREEDY, request_id="same")).result()
            with pytest.raises(DuplicateRequestIdError, match="request id 'same' is already in use"):
                await client.submit([3], GREEDY, request_id="same")
            return duplicate, await first.result()

        duplicate, first = run_with_client(coordinator, scenario)
        assert duplicate["finish_reason"] == "error"
        assert InferenceRequestError.from_dict(duplicate["error"]) == DuplicateRequestIdError(request_id="same")
        assert first["finish_reason"] == "length" and first["generated_tokens"] == 30
        assert_no_routing_state(coordinator)


def test_closing_the_client_resolves_every_handle_and_aborts_in_the_engine():
    engine = HashEngine(step_delay_s=0.002)
    with running_cluster([engine]) as coordinator:

        async def scenario(client):
            handle = await client.submit([1], SamplingParams(max_tokens=4000))
            await async_wait_until(lambda: engine.steps > 1, "generation to start")
            await client.close()
            await client.close()
            with pytest.raises(ClientStateError, match="not started .* or already closed"):
                await client.submit([1], GREEDY)
            return await handle.result()

        result = run_with_client(coordinator, scenario)
        assert result["finish_reason"] == "error" and result["error"]["type"] == "ClientClosedError"
        wait_until(lambda: list(engine.finished.values()) == ["abort"], "the abort to reach the engine")
        assert_no_routing_state(coordinator)


def test_a_silent_engine_is_dropped_its_streamed_request_fails_and_the_other_runs_again_elsewhere():
    coordinator = InferenceCoordinator(heartbeat_timeout_s=1.0).start()
    mute = peer_socket(coordinator, "engine")
    mute.send(encode(MessageKind.REGISTER, engine_id="mute"))
    try:
        wait_until(lambda: coordinator.engine_ids == ("mute",), "the engine to register")

        async def scenario(client):
            streamed = await client.submit([1], GREEDY, request_id="streamed")
            fresh = await client.submit([2], GREEDY, request_id="fresh")
            for _ in range(2):  # both reach the mute engine, which streams one token of the first
                assert (await asyncio.to_thread(receive_command, mute))[0] is MessageKind.SUBMIT
            first = {**error_output("streamed", None), "finished": False, "finish_reason": None}
            mute.send(encode(MessageKind.OUTPUTS, outputs=[{**first, "new_token_ids": [7], "new_log_probs": [0.0]}]))
            assert (await streamed.next_output())["new_token_ids"] == [7]
            with serving(coordinator, [HashEngine()]):  # then it falls silent; another engine is there
                return await streamed.result(), await collect(fresh)

        streamed, fresh = run_with_client(coordinator, scenario)
        assert streamed["finish_reason"] == "error" and streamed["error"]["type"] == EngineLostError.__name__
        assert "engine mute went silent" in streamed["error"]["message"]
        assert [t for out in fresh for t in out["new_token_ids"]] == expected_tokens([2], 6)
        assert coordinator.router.routes == {}
        wait_until(lambda: coordinator.engine_ids == (), "the mute engine's drop and the other's deregister")
    finally:
        mute.close(linger=0)
        coordinator.stop()


def test_malformed_messages_are_counted_and_do_not_stop_the_coordinator():
    with running_cluster([HashEngine()]) as coordinator:
        rogue = peer_socket(coordinator, "client")
        rogue.send(b"\x80\x04not msgpack")
        rogue.send(encode(MessageKind.CONTROL, signal="explode"))
        wait_until(lambda: coordinator.protocol_errors == 2, "both messages to be rejected")
        rogue.close(linger=0)

        async def scenario(client):
            return await (await client.submit([1], GREEDY)).result(), await client.stats()

        result, stats = run_with_client(coordinator, scenario)
        assert result["finish_reason"] == "length"
        assert stats["protocol_errors"] == 2 and stats["engines"][0]["engine_id"] == "engine-0"


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(heartbeat_timeout_s=0.5), "heartbeat_timeout_s must be at least 1.0s (4 heartbeats) or None, got 0.5"),
        (dict(route_timeout_s=0), "route_timeout_s must be > 0 (or None) and max_waiting_requests >= 0; got 0, 1024"),
        (dict(max_waiting_requests=-1), "max_waiting_requests >= 0; got 30.0, -1"),
        (dict(request_timeout_s=-2.0), "request_timeout_s must be > 0 (or None), got -2.0"),
    ],
)
def test_liveness_settings_out_of_range_are_refused_before_anything_binds(settings, message):
    with pytest.raises(CoordinatorConfigError, match=re.escape(message)):
        InferenceCoordinator(**settings)


def test_megatron_serve_refuses_a_bad_deadline_in_one_line_before_reading_the_checkpoint(capsys, tmp_path):
    status = launcher.main(["--load", str(tmp_path / "absent"), "--request-timeout-s", "0"])
    assert status == 2
    assert capsys.readouterr().err == "error: request_timeout_s must be > 0 (or None), got 0.0\n"
