"""A coordinator with engine replicas served by endpoints in threads, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator


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
