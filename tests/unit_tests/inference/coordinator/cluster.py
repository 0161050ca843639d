"""A coordinator with engine replicas served by endpoints in threads, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import zmq

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.coordinator.messages import MessageKind, decode


@contextlib.contextmanager
def running_cluster(engines, **coordinator_options) -> Iterator[InferenceCoordinator]:
    """Serve ``engines`` (one endpoint thread each) behind a fresh coordinator; stop all on exit."""
    coordinator = InferenceCoordinator(**coordinator_options).start()
    try:
        with serving(coordinator, engines):
            yield coordinator
    finally:
        coordinator.stop()


@contextlib.contextmanager
def serving(coordinator: InferenceCoordinator, engines) -> Iterator[list[EngineEndpoint]]:
    """Serve ``engines`` behind a running coordinator, one endpoint thread each, until exit."""
    before = len(coordinator.router.engines)
    endpoints = [
        EngineEndpoint(engine, coordinator.address, engine_id=f"engine-{i}") for i, engine in enumerate(engines)
    ]
    threads = [threading.Thread(target=endpoint.run, daemon=True) for endpoint in endpoints]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(coordinator.router.engines) == before + len(engines), "engines to register")
        yield endpoints
    finally:
        for endpoint in endpoints:
            endpoint.request_stop()
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads), "an endpoint did not stop"


def peer_socket(coordinator: InferenceCoordinator, role: str) -> zmq.Socket:
    """A DEALER socket connected to ``coordinator`` with the key pair of ``role`` ("engine" or "client")."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    coordinator.keys.secure_peer(socket, role)
    socket.connect(coordinator.address)
    return socket


def receive_command(socket: zmq.Socket, timeout_s: float = 10.0) -> tuple:
    """The next message other than a heartbeat that the coordinator sent to ``socket``: ``(kind, payload)``."""
    deadline = time.monotonic() + timeout_s
    while socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        kind, payload = decode(socket.recv())
        if kind is not MessageKind.HEARTBEAT:
            return kind, payload
    raise AssertionError(f"no message from the coordinator within {timeout_s}s")


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)


async def async_wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)


def run_with_client(coordinator: InferenceCoordinator, scenario):
    """Run ``await scenario(client)`` with a started client in a fresh event loop."""

    async def main():
        async with InferenceClient(coordinator.address) as client:
            return await scenario(client)

    return asyncio.run(main())
