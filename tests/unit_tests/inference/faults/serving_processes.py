"""Serving pieces as real processes, and probes of them, for the control-plane fault tests
(``test_item_01`` ... ``test_item_06``).

Run as ``python -m tests.unit_tests.inference.faults.serving_processes ROLE``:

* ``frontend``: a coordinator, an engine double (HashEngine) behind an endpoint and the HTTP
  server in one process, as a one-process megatron-serve runs them (without a model); prints
  ``Coordinator on ADDRESS`` and ``Serving on URL``.
* ``coordinator [--heartbeat-timeout-s S]``: a coordinator alone; prints ``Coordinator on ADDRESS``.
* ``engine ADDRESS [--heartbeat-timeout-s S]``: an engine double behind an endpoint of that
  coordinator; prints ``Engine up``.

Each serves until it is killed (or its parent dies), with the control-plane keys that ``$MEGATRON_CONTROL_PLANE_KEYS``
names when set (a test hands its keys to its processes as megatron-serve does to its replicas).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.coordinator.lifetime import die_with_parent
from megatron.core.inference.coordinator.replicas import PARENT_PID_ENV
from tests.readme import ROOT, command_env
from tests.unit_tests.inference.coordinator.engine_double import TOKENIZER, HashEngine
from tests.unit_tests.inference.launched_server import LaunchedServer, kill_tree

if TYPE_CHECKING:
    import httpx

STEP_DELAY_S = 0.01  # engine doubles take this long per token: streams last while a test acts


@contextlib.contextmanager
def launched_command(command: Sequence[str], env: dict[str, str] | None = None) -> Iterator[LaunchedServer]:
    """``command`` as a subprocess (stdout and stderr read as lines); it and everything it
    started are killed after."""
    process = subprocess.Popen(
        list(command),
        cwd=ROOT,
        env=command_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield LaunchedServer(process)
    finally:
        kill_tree(process)


def launched(role: str, *args: str, env: dict[str, str] | None = None):
    """This module run as ``role`` (see the module doc) by :func:`launched_command`; it is told
    this process's id, so that it dies with it even if this process dies while it starts up."""
    env = {PARENT_PID_ENV: str(os.getpid()), **(env or {})}
    return launched_command([sys.executable, "-m", __spec__.name, role, *args], env)


class StreamedCompletion:
    """One streamed ``/v1/completions`` request, read in two parts: up to its first event, then
    to its end (so that a test can act while it is in flight)."""

    def __init__(self, http: httpx.Client, body: dict):
        self._context = http.stream("POST", "/v1/completions", json={**body, "stream": True})
        self.response: httpx.Response | None = None
        self.events: list[str] = []

    def first(self) -> StreamedCompletion:
        self.response = self._context.__enter__()
        self._lines = (line for line in self.response.iter_lines() if line)
        self.events.append(next(self._lines))
        return self

    def rest(self) -> list[str]:
        """Every event (``data: ...`` lines) once the stream ended."""
        try:
            self.events += list(self._lines)
        finally:
            self._context.__exit__(None, None, None)
        return self.events

    @property
    def errors(self) -> list[dict]:
        return [json.loads(e.removeprefix("data: ")) for e in self.events if e.startswith('data: {"error"')]


def listening_addresses(pids: Sequence[int]) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket the processes ``pids`` listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(int(link[8:-1]))
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                found.add((socket.inet_ntop(family, packed), int(port, 16)))
    return found


def _serve_until_killed() -> None:
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()


def _endpoint_thread(address: str, engine_id: str, **options) -> EngineEndpoint:
    endpoint = EngineEndpoint(HashEngine(step_delay_s=STEP_DELAY_S), address, engine_id=engine_id, **options)
    threading.Thread(target=endpoint.run, daemon=True).start()
    return endpoint


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["frontend", "coordinator", "engine"])
    parser.add_argument("address", nargs="?")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=None)
    args = parser.parse_args(argv)
    # A test that dies takes its serving processes with it, also one that died while this process
    # imported torch (then the parent is init already: the pid it was started by tells).
    die_with_parent(int(os.environ.get(PARENT_PID_ENV, os.getppid())))
    options = {} if args.heartbeat_timeout_s is None else {"heartbeat_timeout_s": args.heartbeat_timeout_s}
    if args.role == "engine":
        _endpoint_thread(args.address, f"engine-{os.getpid()}", **options)
        print("Engine up", flush=True)
        _serve_until_killed()
        return
    coordinator = InferenceCoordinator(**options).start()
    print(f"Coordinator on {coordinator.address}", flush=True)
    if args.role == "frontend":
        # Imported here: an engine (re)started under load pays only for what it uses (no web stack).
        from megatron.core.inference.server import ServerConfig, ServerThread

        _endpoint_thread(coordinator.address, "engine-0")
        client = InferenceClient(coordinator.address)
        server = ServerThread(client, tokenizer=TOKENIZER, config=ServerConfig()).start()
        print(f"Serving on {server.url}", flush=True)
    _serve_until_killed()


if __name__ == "__main__":
    main()
