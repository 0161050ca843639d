"""Issue 19, item 5: losing one data-parallel replica (SIGKILL) takes no other one down.

``tools/run_text_generation_server.py --data-parallel-size 2`` on a checkpoint: with 8 streams
in flight, replica 1 is killed. Every stream still gets HTTP 200 and ends with ``[DONE]``; the
streams replica 1 served end with exactly one error event (503 unavailable), the others finish.
Replica 0 keeps serving meanwhile; replica 1 is started again, registers again and serves.
Every listener of the supervisor and its replicas is on loopback (the replicas' rendezvous
stores included); replicas get only the engine keys, in a private file. Killing the supervisor
kills its replicas (no orphan)."""

import concurrent.futures
import json
import os
import re
import signal
import stat
import sys
import time

import httpx
import pytest

from tests.readme import ROOT, needs_a_device_per_rank
from tests.unit_tests.inference.coordinator.cluster import wait_until
from tests.unit_tests.inference.faults.serving_processes import (
    StreamedCompletion,
    launched_command,
    listening_addresses,
)
from tests.unit_tests.inference.launched_server import alive, descendants
from tests.unit_tests.inference.test_serve_launchers import trained_checkpoint

LAUNCHER = str(ROOT / "tools" / "run_text_generation_server.py")
STREAMS = 8
LOOPBACK = {"127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory)


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {engine: float(value) for engine, value in re.findall(rf'{name}\{{engine="([^"]+)"\}} (\S+)', text)}


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(entry.decode().split("=", 1) for entry in f.read().split(b"\0") if b"=" in entry)


def test_a_killed_replica_fails_only_its_own_streams_and_comes_back(checkpoint):
    needs_a_device_per_rank(2)
    command = [sys.executable, LAUNCHER, "--load", checkpoint, "--data-parallel-size", "2", "--port", "0"]
    with launched_command(command + ["--kv-block-size", "8", "--max-requests", "8"]) as server:
        started = [server.wait_for(r"replica (\d): started, pids \[(\d+)\]").groups() for _ in range(2)]
        pids = {int(index): int(pid) for index, pid in started}
        url = server.wait_for_url()
        supervisor = server.process.pid
        listening = listening_addresses([supervisor, *pids.values()])
        assert {address for address, _ in listening} <= LOOPBACK and len(listening) >= 5, listening  # stores too
        keys_file = _environ(pids[1])["MEGATRON_CONTROL_PLANE_KEYS"]
        assert stat.S_IMODE(os.stat(keys_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(keys_file)).st_mode) == 0o700
        assert sorted(json.load(open(keys_file))) == ["coordinator_public", "engine_public", "engine_secret"]

        body = {"model": "megatron", "max_tokens": 110, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as http:
            streams = [StreamedCompletion(http, {**body, "prompt": f"s{i}"}) for i in range(STREAMS)]
            with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
                list(pool.map(StreamedCompletion.first, streams))  # every stream is under way
                os.kill(pids[1], signal.SIGKILL)
                ends = list(pool.map(StreamedCompletion.rest, streams))
        assert [stream.response.status_code for stream in streams] == [200] * STREAMS
        assert all(events[-1] == "data: [DONE]" for events in ends)
        assert all(len(stream.errors) <= 1 for stream in streams)
        failed = [stream.errors[0]["error"]["code"] for stream in streams if stream.errors]
        assert 0 < len(failed) < STREAMS, "replica 1 served some streams, replica 0 the others"
        assert set(failed) == {"unavailable"}

        completion = {"model": "megatron", "prompt": "while one is down", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=completion, timeout=60).status_code == 200
        index, pid = server.wait_for(r"replica (\d): started, pids \[(\d+)\]").groups()
        assert index == "1" and int(pid) != pids[1]
        wait_until(
            lambda: "replica-1" in _metric(url, "megatron_engine_pending_requests"),
            "replica 1 to register",
            timeout_s=90,
        )

        def replica_1_serves() -> bool:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                statuses = list(
                    pool.map(lambda _: httpx.post(url + "/v1/completions", json=completion, timeout=60), range(4))
                )
            assert all(response.status_code == 200 for response in statuses)
            return _metric(url, "megatron_engine_tokens_generated").get("replica-1", 0) > 0

        wait_until(replica_1_serves, "the restarted replica 1 to serve", timeout_s=30)

        replicas = descendants(supervisor)
        os.kill(supervisor, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(map(alive, replicas)):
            assert time.monotonic() < deadline, "replicas outlived their supervisor"
            time.sleep(0.05)
