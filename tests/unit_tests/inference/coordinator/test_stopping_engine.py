"""A stopping engine replica takes no new request: it refuses the submit with a typed error and
the coordinator runs the request on a live replica, or answers 503 when none is left. Real
processes and sockets: engine replicas (HashEngine behind an endpoint) in processes of their
own, the coordinator and client (and HTTP server) here.

To have a submit reach a replica that is stopping, the replica is frozen (SIGSTOP) while a
``stop`` signal and then the submit queue up for it, behind a long request it is serving (the
abort of which keeps it stopping for a step); continued (SIGCONT), it reads both in order."""

import asyncio
import concurrent.futures
import contextlib
import os
import signal

import httpx

from megatron.core.inference import coordinator as control_plane
from megatron.core.inference.coordinator import EngineStoppingError, InferenceClient, InferenceCoordinator
from megatron.core.inference.coordinator.messages import MessageKind, encode, error_dict, error_output
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.server import ServerConfig, ServerThread
from tests.unit_tests.inference.coordinator.cluster import (
    async_wait_until,
    peer_socket,
    receive_command,
    run_with_client,
    serving,
    wait_until,
)
from tests.unit_tests.inference.coordinator.engine_double import TOKENIZER, HashEngine, expected_tokens
from tests.unit_tests.inference.faults.serving_processes import launched

LONG = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)  # 40 s at the replica's pace
SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@contextlib.contextmanager
def _coordinator(tmp_path):
    """A coordinator and a function starting engine replica processes of it (with the engine keys)."""
    keys = control_plane.ControlPlaneKeys.generate()
    keys_file = keys.for_role("engine").save(str(tmp_path / "engine.json"))
    coordinator = InferenceCoordinator(keys=keys).start()

    @contextlib.contextmanager
    def replica():
        with launched("engine", coordinator.address, env={control_plane.auth.KEYS_ENV: keys_file}) as process:
            process.wait_for("Engine up")
            engine_id = f"engine-{process.process.pid}"
            wait_until(lambda: engine_id in coordinator.engine_ids, f"{engine_id} to register")
            yield process.process.pid, engine_id

    try:
        yield coordinator, replica
    finally:
        coordinator.stop()


def _pending(coordinator: InferenceCoordinator) -> dict[str, int]:
    return {e["engine_id"]: e["pending"] for e in coordinator.stats()["engines"]}


async def _stop_frozen(client: InferenceClient, pid: int) -> None:
    """Freeze replica ``pid`` and queue a ``stop`` for every registered replica (it alone, here)."""
    os.kill(pid, signal.SIGSTOP)
    await client.control("stop")


def test_a_stopping_replica_refuses_a_submit_and_the_coordinator_runs_it_on_a_live_one(tmp_path):
    with _coordinator(tmp_path) as (coordinator, replica), replica() as (stopping_pid, stopping_id):

        async def scenario():
            async with InferenceClient(coordinator.address, keys=coordinator.keys.for_role("client")) as client:
                long = await client.submit([1, 2], LONG)
                await long.next_output()  # the stopping replica serves it
                await _stop_frozen(client, stopping_pid)
                with replica() as (_, live_id):  # registered after the stop: it keeps serving
                    balance = await client.submit([3, 4], LONG)  # to the live replica (less load)
                    moved = await client.submit([5, 6], SHORT)  # to the stopping one (equal load, registered first)
                    await async_wait_until(
                        lambda: _pending(coordinator) == {stopping_id: 2, live_id: 1}, "the three requests routed"
                    )
                    os.kill(stopping_pid, signal.SIGCONT)
                    moved_tokens = [t async for output in moved for t in output["new_token_ids"]]
                    results = [await handle.result() for handle in (long, moved)]
                    await async_wait_until(lambda: coordinator.engine_ids == (live_id,), "the stopped one to leave")
                    balance.abort()
                    results.append(await balance.result())
                    return results, moved_tokens, coordinator.stats()

        (long, moved, balance), moved_tokens, stats = asyncio.run(scenario())

    assert long["finish_reason"] == "abort"  # the stop aborted what the replica was serving
    assert moved["finish_reason"] == "length" and moved["error"] is None, moved
    assert moved_tokens == expected_tokens([5, 6], 5) and stats["refused_submits"] == 1
    assert balance["finish_reason"] == "abort"
    assert (stats["in_flight"], stats["unrouted"], stats["internal_errors"]) == (0, 0, 0)


def test_a_submit_refused_by_the_last_stopping_replica_is_a_503(tmp_path):
    with _coordinator(tmp_path) as (coordinator, replica), replica() as (stopping_pid, stopping_id):
        client = InferenceClient(coordinator.address, keys=coordinator.keys.for_role("client"))
        with ServerThread(client, tokenizer=TOKENIZER, config=ServerConfig()) as server:

            async def stop_while_serving():
                async with InferenceClient(coordinator.address, keys=coordinator.keys.for_role("client")) as control:
                    long = await control.submit([1, 2], LONG)
                    await long.next_output()
                    await _stop_frozen(control, stopping_pid)
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        body = {"model": "megatron", "prompt": "refused", "max_tokens": 3}
                        refused = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
                        await async_wait_until(lambda: _pending(coordinator) == {stopping_id: 2}, "the submit routed")
                        os.kill(stopping_pid, signal.SIGCONT)
                        return await long.result(), await asyncio.wrap_future(refused)

            long, refused = asyncio.run(stop_while_serving())
            wait_until(lambda: not coordinator.engine_ids, "the stopped replica to leave")
            stats = coordinator.stats()

    assert long["finish_reason"] == "abort"
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "unavailable"
    assert error["message"] == f"engine {stopping_id} is stopping and no other engine replica takes requests"
    assert (stats["refused_submits"], stats["in_flight"], stats["unrouted"]) == (1, 0, 0)


def test_an_abort_that_crosses_a_refusal_or_a_deregister_ends_the_request_without_running_it_again():
    """The client aborts while its request is on the way to a replica that then refuses it (or
    leaves): the request ends aborted and never reaches the live replica. The leaving replica
    is a socket driven here, sending what a stopping endpoint sends."""
    coordinator = InferenceCoordinator().start()
    leaving = peer_socket(coordinator, "engine")
    leaving.send(encode(MessageKind.REGISTER, engine_id="leaving"))
    try:
        wait_until(lambda: coordinator.engine_ids == ("leaving",), "the engine to register")
        live = HashEngine()

        async def scenario(client):
            handles = [await client.submit([i], SHORT, request_id=f"r{i}") for i in range(2)]
            for _ in handles:
                assert (await asyncio.to_thread(receive_command, leaving))[0] is MessageKind.SUBMIT
            with serving(coordinator, [live]):
                for handle in handles:
                    handle.abort()
                    assert (await asyncio.to_thread(receive_command, leaving))[0] is MessageKind.ABORT
                refusal = error_output("r0", error_dict(EngineStoppingError("engine leaving is stopping")))
                leaving.send(encode(MessageKind.OUTPUTS, outputs=[refusal]))
                first = await handles[0].result()
                leaving.send(encode(MessageKind.DEREGISTER, engine_id="leaving"))  # r1 still routed to it
                return first, await handles[1].result(), coordinator.stats()

        first, second, stats = run_with_client(coordinator, scenario)
        assert (first["finish_reason"], second["finish_reason"]) == ("abort", "abort")
        assert live.log == [] and stats["refused_submits"] == 1
        assert (stats["in_flight"], stats["unrouted"]) == (0, 0)
    finally:
        leaving.close(linger=0)
        coordinator.stop()
