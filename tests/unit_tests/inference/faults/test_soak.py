"""Issue 19, soak: the whole serving stack under load while things break, through real
processes and sockets.

For at least ``$MEGATRON_SOAK_S`` seconds (15 by default: about 30 s in all on an idle 2-core
host) 200 concurrent clients stream greedy ``/v1/completions`` from the real HTTP server, each
cancelling about one stream in three at a random point. Behind the coordinator serve two engine
replicas in processes of their own and one disaggregated replica (a real decode engine here,
its prefill worker in a child process, KV moved by NIXL). Meanwhile: malformed ZeroMQ frames
reach the coordinator (unauthenticated and authenticated), one replica is killed (SIGKILL) and
started again as a new process, and the prefill worker is killed, after which its decode
replica is taken out of service (while it stops, it refuses new submits and the coordinator
runs them on the other replicas) and a replacement pair (a prefill worker and a decode replica
over it) joins. The load lasts until every fault was injected and both the restarted replica
and the replacement pair generated tokens, so that a slow restart on a loaded host never moves
a fault out of the storm.

Every request gets exactly one terminal reply (none lost): a stream that was not cancelled
gets HTTP 200 and a finish or one error event before ``[DONE]``, or an error response (503)
for a request that failed before its first token. Its text equals that of a reference run
(the same request on the same engine, in this process, with no faults): a hash engine's or
the disaggregated replicas' model's; a cancelled or failed stream's text is a prefix of it. The
only errors are ``unavailable`` ones of requests in flight on the killed replica (those that
had streamed output: the coordinator runs the others again on another replica) and of requests
whose KV the decode replica was pulling from the killed prefill worker (a handoff failure is a
503, see ``test_handoff_failures_are_503``). Afterwards the coordinator has nothing in flight
and no load on any engine, the server still serves, and each decode engine, once retired, has
all its blocks back and no quarantined block left.

Every wait has a deadline that fails naming what did not happen; every process the test
started is killed and reaped, also when it fails."""

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import httpx
import zmq

from megatron.core.inference import coordinator as control_plane
from megatron.core.inference.coordinator import InferenceClient, InferenceCoordinator
from megatron.core.inference.coordinator.messages import MessageKind, encode
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.server import ServerConfig, ServerThread
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.inference.coordinator.cluster import peer_socket
from tests.unit_tests.inference.coordinator.engine_double import TOKENIZER, HashEngine
from tests.unit_tests.inference.faults.handoff_peers import DisaggregatedReplicaPeer, PrefillWorkerPeer, wait_until
from tests.unit_tests.inference.faults.serving_processes import launched

SOAK_S = float(os.environ.get("MEGATRON_SOAK_S", "15"))
STREAMS = 200
CANCEL_FRACTION = 0.3
# The coordinator drops a replica (or a client) silent this long: a killed one, but also a live
# process that a loaded host starved of CPU for a while (3 s was too short there); 40 heartbeats.
HEARTBEAT_TIMEOUT_S = 10.0
# Longer than a prefill waits on a loaded 2-core host (30 s was seen to pass): the killed prefill
# worker's requests end when its replica is retired (which refuses new submits while it stops:
# the coordinator sends them to a live replica), not by this timeout.
PREFILL_TIMEOUT_S = 120.0
# A replica process is a fresh interpreter: importing torch takes about 3 s of CPU, which the
# storm (more runnable processes than cores) and the other jobs of a shared CI host stretch
# (once past 90 s). Waiting for it is no fault of the serving stack; its deadline is generous.
STARTUP_TIMEOUT_S = 180.0
WAIT_S = 60.0  # every other wait
# A client's read timeout (a stream silent this long hangs): a prefill can wait its own timeout.
STREAM_TIMEOUT_S = PREFILL_TIMEOUT_S
# The backstop of the harness, above the sum of the waits that can follow one another.
TEST_TIMEOUT_S = SOAK_S + 2 * STARTUP_TIMEOUT_S + STREAM_TIMEOUT_S + 7 * WAIT_S
# The disaggregated replicas: a tiny model over the server's byte-level vocabulary, room for
# their share of the streams (prompts of up to 8 tokens plus up to 24 generated).
MODEL = dict(vocab_size=TOKENIZER.vocab_size)
# The clients share this process (and its GIL) with the server: on a starved host the server's
# own lag would count against their request heads and bodies (a reset, seen after 10 s). Slow
# clients are test_item_11's subject, not this one's.
SERVER = ServerConfig(header_timeout_s=STREAM_TIMEOUT_S, body_timeout_s=STREAM_TIMEOUT_S)
ENGINE = dict(num_blocks=512, max_requests=32, tokenizer=TOKENIZER)


@dataclass
class Outcome:
    """What one client saw of one streamed request."""

    prompt: list[int]
    max_tokens: int
    started: float
    ended: float = 0.0
    status: int = 0
    text: str = ""  # the text deltas, concatenated
    finish_reasons: list[str] = field(default_factory=list)  # of the choices that reported one
    errors: list[dict] = field(default_factory=list)  # error events (or the error body of a refused request)
    done: int = 0  # [DONE] events
    cancelled: bool = False


async def _sse_lines(response: httpx.Response):
    """The non-empty lines of an event stream. Split on newlines only (as SSE does): httpx's
    ``aiter_lines`` also splits on U+0085 or U+2028, which JSON leaves unescaped in text."""
    pending = b""
    async for chunk in response.aiter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line.strip():
                yield line.decode().rstrip("\r")
    if pending.strip():
        yield pending.decode()


async def _stream(http: httpx.AsyncClient, rng: random.Random) -> Outcome:
    prompt = [rng.randrange(1, 120) for _ in range(rng.randint(2, 8))]
    max_tokens = rng.randint(4, 24)
    body = dict(model="megatron", prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True)
    cancel_after = rng.randint(1, 8) if rng.random() < CANCEL_FRACTION else None
    outcome = Outcome(prompt, max_tokens, started=time.monotonic())
    async with http.stream("POST", "/v1/completions", json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.errors.append(json.loads(await response.aread())["error"])
        else:
            events = 0
            async for line in _sse_lines(response):
                events += 1
                if line == "data: [DONE]":
                    outcome.done += 1
                    continue
                data = json.loads(line.removeprefix("data: "))
                if "error" in data:
                    outcome.errors.append(data["error"])
                else:
                    for choice in data["choices"]:
                        outcome.text += choice.get("text") or ""
                        if choice.get("finish_reason") is not None:
                            outcome.finish_reasons.append(choice["finish_reason"])
                if cancel_after is not None and events >= cancel_after and not outcome.done:
                    outcome.cancelled = True  # the client leaves: closing the response aborts the request
                    break
    outcome.ended = time.monotonic()
    return outcome


class Load:
    """``STREAMS`` clients in a thread of their own, each streaming one request after another
    until :meth:`stop`; :meth:`join` re-raises what a client raised."""

    def __init__(self, url: str):
        self.outcomes: list[Outcome] = []
        self.sent = 0  # requests a client started
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url,), name="soak-load", daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        async def client(http: httpx.AsyncClient, index: int) -> None:
            rng = random.Random(index)
            while not self._stop.is_set():
                self.sent += 1
                self.outcomes.append(await _stream(http, rng))

        async def main() -> None:
            # A connection per stream: a kept-alive connection that the server closes as idle while
            # the client sends on it is HTTP's own race (httpx does not retry POSTs), not a fault here.
            limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=url, timeout=STREAM_TIMEOUT_S, limits=limits) as http:
                await asyncio.gather(*(client(http, index) for index in range(STREAMS)))

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - join() raises it in the test's thread
            self._error = exc

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> None:
        """Raise what a client raised (the storm ended early)."""
        if self._error is not None:
            raise AssertionError("a client of the storm failed") from self._error

    def join(self) -> None:
        self.stop()
        self._thread.join(STREAM_TIMEOUT_S + WAIT_S)
        assert not self._thread.is_alive(), f"the clients did not end within {STREAM_TIMEOUT_S + WAIT_S:g}s of the stop"
        if self._error is not None:
            raise self._error


def _malformed_frames(coordinator: InferenceCoordinator) -> int:
    """Garbage at the coordinator: unauthenticated (never gets a frame in) and authenticated
    (dropped and counted); returns how many authenticated messages were malformed."""
    context = zmq.Context()
    try:
        stranger = context.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(coordinator.address)
        # Never blocking: once its handshake failed the socket may have no peer to queue for.
        with contextlib.suppress(zmq.Again):
            stranger.send_multipart([b"two", b"frames"], zmq.NOBLOCK)
            stranger.send(os.urandom(4096), zmq.NOBLOCK)
    finally:
        context.destroy(linger=0)
    parsed = urllib.parse.urlparse(coordinator.address)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=WAIT_S) as raw:
        raw.sendall(os.urandom(16 * 1024))
    client, engine = peer_socket(coordinator, "client"), peer_socket(coordinator, "engine")
    client.send_multipart([b"two", b"frames"])
    client.send(os.urandom(8 * 1024))
    client.send(encode(MessageKind.OUTPUTS, outputs=[]))  # a client may not report outputs
    engine.send(encode(MessageKind.CONTROL, signal="stop"))  # an engine may not control
    engine.send(b"\x80\x04not msgpack")
    # Sockets closed early drop what they have not sent: wait until the coordinator counted them.
    wait_until(lambda: coordinator.protocol_errors == 5, "five malformed messages to be counted", WAIT_S)
    client.close()
    engine.close()
    return 5


def _replica(address: str, keys_file: str):
    """An engine replica (a HashEngine behind an endpoint) in a process of its own."""
    return launched(
        "engine",
        address,
        "--heartbeat-timeout-s",
        str(HEARTBEAT_TIMEOUT_S),
        env={control_plane.auth.KEYS_ENV: keys_file},
    )


def _started(replica) -> str:
    """The engine id of a replica process, once it is up."""
    replica.wait_for("Engine up", timeout_s=STARTUP_TIMEOUT_S)
    return f"engine-{replica.process.pid}"


def _engine_ids(coordinator: InferenceCoordinator, ids: set[str], what: str) -> None:
    wait_until(lambda: set(coordinator.engine_ids) == ids, f"{what} (engines: {coordinator.engine_ids})", WAIT_S)


def _engine_stats(coordinator: InferenceCoordinator, engine_id: str) -> dict:
    return next((e for e in coordinator.stats()["engines"] if e["engine_id"] == engine_id), {})


def _generated(coordinator: InferenceCoordinator, engine_id: str) -> int:
    return (_engine_stats(coordinator, engine_id).get("stats") or {}).get("tokens_generated", 0)


def test_soak(tmp_path):
    run_distributed(_soak_on_one_rank, 1, tmp_path, timeout_s=TEST_TIMEOUT_S)


def _soak_on_one_rank(tmp_path) -> None:
    pg = ProcessGroupCollection.from_layout(RankLayout())
    began = time.monotonic()
    timeline: dict[str, float] = {}  # seconds since the test began, printed for a failure's post-mortem

    def mark(event: str) -> None:
        timeline[event] = round(time.monotonic() - began, 2)

    keys = control_plane.ControlPlaneKeys.generate()
    # Forked before NIXL or ZeroMQ exist here (so the replacement pair is forked now, idle until needed).
    worker = PrefillWorkerPeer(pg=pg, model_overrides=MODEL, keys=keys, **ENGINE)
    decode = DisaggregatedReplicaPeer(pg=pg, model_overrides=MODEL, **ENGINE)
    new_worker = PrefillWorkerPeer(pg=pg, model_overrides=MODEL, keys=keys, **ENGINE)
    new_decode = DisaggregatedReplicaPeer(pg=pg, model_overrides=MODEL, **ENGINE)
    keys_file = keys.for_role("engine").save(str(tmp_path / "engine.json"))
    coordinator = InferenceCoordinator(keys=keys, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S).start()
    client = InferenceClient(coordinator.address, keys=keys.for_role("client"))
    server = ServerThread(client, tokenizer=TOKENIZER, config=SERVER)
    mark("peers forked")
    load = None
    try:
        decode.serve(
            coordinator.address, keys_file, worker.address, engine_id="decode", prefill_timeout_s=PREFILL_TIMEOUT_S
        )
        with _replica(coordinator.address, keys_file) as first, _replica(coordinator.address, keys_file) as second:
            first_id, second_id = _started(first), _started(second)
            _engine_ids(coordinator, {first_id, second_id, "decode"}, "three replicas to register")
            server.start()
            load = Load(server.url)
            started = time.monotonic()
            mark("storm started")

            def at(fraction: float) -> None:
                time.sleep(max(0.0, started + fraction * SOAK_S - time.monotonic()))

            at(0.1)
            malformed = _malformed_frames(coordinator)
            mark("malformed frames counted")

            at(0.2)
            wait_until(
                lambda: _engine_stats(coordinator, first_id).get("pending", 0) > 0,
                "requests in flight on the replica to kill",
                WAIT_S,
            )
            killed_at = time.monotonic()
            os.kill(first.process.pid, signal.SIGKILL)
            mark("replica killed")
            with _replica(coordinator.address, keys_file) as restarted:  # started again at once
                wait_until(lambda: first_id not in coordinator.engine_ids, "the killed replica to be dropped", WAIT_S)
                replica_window = (killed_at, time.monotonic())  # requests in flight here on the killed replica may fail
                mark("killed replica dropped")
                restarted_id = _started(restarted)
                mark("restarted replica up")
                _engine_ids(coordinator, {restarted_id, second_id, "decode"}, "the restarted replica to register")
                mark("restarted replica registered")

                at(0.5)
                worker_killed_at = time.monotonic()
                worker.kill()  # in the middle of prefills and transfers
                mark("prefill worker killed")
                retired = decode.retire()  # out of service: its in-flight requests end (aborted)
                # requests whose KV the decode replica was pulling from the killed worker here may fail
                worker_window = (worker_killed_at, time.monotonic())
                mark("decode replica retired")
                _engine_ids(coordinator, {restarted_id, second_id}, "the decode replica to deregister")
                new_decode.serve(
                    coordinator.address,
                    keys_file,
                    new_worker.address,
                    engine_id="decode-2",
                    prefill_timeout_s=PREFILL_TIMEOUT_S,
                )
                _engine_ids(coordinator, {restarted_id, second_id, "decode-2"}, "the new decode replica to register")
                mark("replacement pair registered")
                for engine_id in (restarted_id, "decode-2"):  # back, and serving the storm
                    wait_until(
                        lambda e=engine_id: load.check() or _generated(coordinator, e) > 0,
                        f"{engine_id} to generate",
                        WAIT_S,
                    )
                mark("replacements generated")

                at(1.0)
                load.join()
                mark("load ended")
                wait_until(lambda: _idle(coordinator.stats()), "the coordinator and its engines to be idle", WAIT_S)
                final = httpx.post(
                    server.url + "/v1/completions",
                    json={"model": "megatron", "prompt": "after", "max_tokens": 3},
                    timeout=WAIT_S,
                )
                assert final.status_code == 200 and final.json()["choices"][0]["finish_reason"] == "length", final.text
                stats = coordinator.stats()
                assert {e["engine_id"] for e in stats["engines"]} == {restarted_id, second_id, "decode-2"}, stats
                new_retired = new_decode.retire()
                mark("replacement decode replica retired")
    finally:
        if load is not None:
            load.stop()
        if server.uvicorn_server.started:  # else a failure before it started is the one to report
            server.stop()
        coordinator.stop()
        for peer in (worker, decode, new_worker, new_decode):
            peer.close()
        print(f"soak timeline (s): {json.dumps(timeline)}; load average {os.getloadavg()}", flush=True)

    assert (stats["protocol_errors"], stats["internal_errors"]) == (malformed, 0)
    for report in (retired, new_retired):
        assert report["blocks_back"] and report["storage"]["idle"], report
        assert report["storage"]["quarantined_blocks"] == 0, report
    _check_replies(load, [replica_window, worker_window], worker_window)
    _check_texts(pg, load.outcomes)
    mark("replies and texts checked")
    print(f"soak: {len(load.outcomes)} streams; timeline (s): {json.dumps(timeline)}", flush=True)


def _idle(stats: dict) -> bool:
    return (stats["in_flight"], stats["unrouted"]) == (0, 0) and all(e["pending"] == 0 for e in stats["engines"])


def _overlaps(outcome: Outcome, window: tuple[float, float]) -> bool:
    return outcome.started <= window[1] and outcome.ended >= window[0]


def _check_replies(load: Load, error_windows: list[tuple[float, float]], retire_window: tuple[float, float]) -> None:
    """One terminal reply per stream: ``length`` (asked for ``max_tokens`` with ``ignore_eos``), or
    ``abort`` for one in flight on the decode replica while it was retired (a stopping engine
    aborts what it serves), or an ``unavailable`` error of one in flight on a replica or worker
    that was killed."""
    outcomes = load.outcomes
    assert len(outcomes) == load.sent, f"{load.sent} requests sent, {len(outcomes)} answered"
    cancelled = [o for o in outcomes if o.cancelled]
    finished = [o for o in outcomes if not o.cancelled]
    assert len(outcomes) > STREAMS and cancelled and finished, (len(outcomes), len(cancelled))
    for outcome in finished:
        if outcome.status == 200:
            assert outcome.done == 1 and len(outcome.finish_reasons) + len(outcome.errors) == 1, outcome
        else:  # failed before its first token: the error is the response
            refused = (outcome.status, outcome.done, outcome.finish_reasons, len(outcome.errors))
            assert refused == (503, 0, [], 1), outcome
    for outcome in outcomes:
        assert set(outcome.finish_reasons) <= {"length", "abort"}, outcome
        if "abort" in outcome.finish_reasons:
            assert _overlaps(outcome, retire_window), (outcome, retire_window)
        if outcome.errors:
            assert [e["code"] for e in outcome.errors] == ["unavailable"], outcome
            assert any(_overlaps(outcome, window) for window in error_windows), (outcome, error_windows)


def _check_texts(pg, outcomes: list[Outcome]) -> None:
    """Each stream's text against a reference run of its request on a hash engine and on the
    disaggregated replicas' model (a plain engine of the same config): the whole text of a
    completed stream, a prefix of it for a cancelled, aborted or failed one."""
    complete = {id(o) for o in outcomes if not o.cancelled and o.finish_reasons == ["length"]}

    def matches(outcome: Outcome, reference: str) -> bool:
        return outcome.text == reference if id(outcome) in complete else reference.startswith(outcome.text)

    requests = {(tuple(o.prompt), o.max_tokens) for o in outcomes}
    by_hash = _reference_texts(HashEngine(), requests)
    rest = [o for o in outcomes if not matches(o, by_hash[tuple(o.prompt), o.max_tokens])]
    by_model = _model_reference_texts(pg, {(tuple(o.prompt), o.max_tokens) for o in rest})
    wrong = [(o, by_model[tuple(o.prompt), o.max_tokens]) for o in rest]
    wrong = [(o, reference) for o, reference in wrong if not matches(o, reference)]
    assert not wrong, f"{len(wrong)} streams differ from the reference run, e.g. (stream, model's text) {wrong[:3]}"
    served_by_model = sum(id(o) in complete for o in rest)
    assert served_by_model > 0, "no completed stream came from the disaggregated replicas"
    assert len(complete) - served_by_model > 0, "no completed stream came from the engine replicas"


def _model_reference_texts(pg, requests: set[tuple[tuple[int, ...], int]]) -> dict:
    from tests.unit_tests.inference.handoff.common import build_engine, build_model

    return _reference_texts(build_engine(build_model("gpt", pg, **MODEL), pg, **ENGINE), requests)


def _reference_texts(engine, requests: set[tuple[tuple[int, ...], int]]) -> dict:
    """``{(prompt, max_tokens): text}`` of greedy requests (as the server asks for them) run on ``engine``."""
    keys = sorted(requests)
    texts = {str(i): "" for i in range(len(keys))}
    for i, (prompt, max_tokens) in enumerate(keys):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(str(i), list(prompt), params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            texts[output.request_id] += output.new_text or ""
    return {key: texts[str(i)] for i, key in enumerate(keys)}
