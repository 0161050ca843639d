"""The coordinator: one ZeroMQ ROUTER socket between clients and data-parallel engine replicas.

Clients and engine endpoints connect DEALER sockets to it, authenticated by CURVE keys of
their role (see :mod:`~megatron.core.inference.coordinator.auth`): nothing from a peer without
a key of this launch is ever read, and each message arrives tagged with its sender's role, so
only engines register and report outputs, and only clients submit, abort, query and control.

A client's ``submit`` goes to the engine with the least pending load (see :class:`LoadRouter`),
its ``abort`` follows the request to that engine, and ``control`` signals go to every engine.
Engine ``outputs`` go back to the client that submitted each request; a terminal output ends
the request's routing entry. While no engine is registered, requests wait (at most
``max_waiting_requests`` of them, each at most ``route_timeout_s``).

Liveness: engines report stats a few times a second and the coordinator sends every engine a
heartbeat as often; clients send heartbeats and are answered with the engines registered. An
engine silent for ``heartbeat_timeout_s`` is dropped; a client silent as long has its requests
aborted. When an engine leaves or is dropped, a request of it that has streamed nothing yet
is run again on another engine (once; it waits for one when none is left), every other one
gets an :class:`EngineLostError` reply. A stopping engine refuses new submits
(:class:`~megatron.core.inference.coordinator.messages.EngineStoppingError`): from then on it
gets nothing new, and the refused request goes to another engine, or gets a
:class:`NoEngineAvailableError` reply when every engine left is stopping. With
``request_timeout_s`` a request not finished that long after its submit ends with a
:class:`RequestTimeoutError` reply (and its engine aborts it). A client's abort is honoured
whatever happens to its engine meanwhile (a request aborted before a rerun or a reroute is
not run again).

Every request gets exactly one terminal reply, and nothing a peer sends stops the loop: a
message that is not one well-formed frame is dropped and counted (``protocol_errors`` in
:meth:`InferenceCoordinator.stats`), a malformed ``submit`` with a usable request id is answered
with an error, and a malformed output fails only its own request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from megatron.core.errors import MegatronConfigError, MegatronRuntimeError
from megatron.core.inference.coordinator.auth import ControlPlaneKeys, Role, ZapHandler, launch_keys
from megatron.core.inference.coordinator.messages import (
    HEARTBEAT_INTERVAL_S,
    MessageKind,
    ProtocolError,
    abort_output,
    check_output,
    decode,
    encode,
    error_dict,
    error_output,
    is_stopping_refusal,
    submitted_request_id,
)
from megatron.core.inference.coordinator.routing import LoadRouter
from megatron.core.inference.errors import DuplicateRequestIdError
from megatron.core.inference.prompts import PromptTypeError, prompt_token_ids

logger = logging.getLogger(__name__)

# What each role may send; anything else from it is dropped and counted.
ACCEPTED_KINDS: dict[str, frozenset[MessageKind]] = {
    Role.CLIENT: frozenset(
        {MessageKind.SUBMIT, MessageKind.ABORT, MessageKind.CONTROL, MessageKind.STATS, MessageKind.HEARTBEAT}
    ),
    Role.ENGINE: frozenset(
        {MessageKind.REGISTER, MessageKind.DEREGISTER, MessageKind.ENGINE_STATS, MessageKind.OUTPUTS}
    ),
}
MAX_RERUNS = 1  # how often a request that streamed nothing is run again after losing its engine
MAX_MESSAGES_PER_POLL = 1024  # then heartbeats, timeouts and authentication get their turn


class EngineLostError(MegatronRuntimeError):
    """The engine serving a request left or went silent before the request finished."""


class CoordinatorStoppedError(MegatronRuntimeError):
    """The coordinator stopped while the request was in flight."""


class NoEngineAvailableError(MegatronRuntimeError):
    """No engine replica registered while the request waited for one (``route_timeout_s``)."""


class WaitingQueueFullError(MegatronRuntimeError):
    """No engine replica is registered and ``max_waiting_requests`` requests already wait for one."""


class RequestTimeoutError(MegatronRuntimeError):
    """The request did not finish within the coordinator's ``request_timeout_s``."""


class MalformedOutputError(MegatronRuntimeError):
    """The engine sent an output for the request that is not a well-formed request output."""


class CoordinatorConfigError(MegatronConfigError):
    """Coordinator settings out of range (the message names them)."""


def check_settings(
    heartbeat_timeout_s: float | None,
    route_timeout_s: float | None,
    max_waiting_requests: int,
    request_timeout_s: float | None = None,
):
    """Raise :class:`CoordinatorConfigError` for liveness, waiting and deadline settings out of range."""
    if heartbeat_timeout_s is not None and heartbeat_timeout_s < 4 * HEARTBEAT_INTERVAL_S:
        raise CoordinatorConfigError(
            f"heartbeat_timeout_s must be at least {4 * HEARTBEAT_INTERVAL_S}s (4 heartbeats) or None, "
            f"got {heartbeat_timeout_s}"
        )
    if (route_timeout_s is not None and route_timeout_s <= 0) or max_waiting_requests < 0:
        raise CoordinatorConfigError(
            "route_timeout_s must be > 0 (or None) and max_waiting_requests >= 0; got "
            f"{route_timeout_s}, {max_waiting_requests}"
        )
    if request_timeout_s is not None and request_timeout_s <= 0:
        raise CoordinatorConfigError(f"request_timeout_s must be > 0 (or None), got {request_timeout_s}")


@dataclass
class _Request:
    """What the coordinator keeps of a request until its terminal reply."""

    client: bytes
    submit: dict[str, Any]  # the submit payload, to run it again on another engine
    submitted_at: float  # monotonic seconds
    streamed: bool = False  # an output of it reached its client
    reruns: int = 0
    aborted: bool = False  # its client asked for an abort (a rerun or reroute answers it instead)


class InferenceCoordinator:
    """Routes requests between clients and engine replicas over one ROUTER socket.

    Args:
        host: interface to bind (loopback unless told otherwise).
        port: TCP port; 0 picks a free one (see :attr:`address`).
        keys: the control-plane keys with the coordinator's secret key; None: :func:`launch_keys`.
        prefix_weight, prefix_block_size: prefix-aware scoring (see :class:`LoadRouter`).
        heartbeat_timeout_s: an engine or client silent this long is gone (see the module doc);
            None never drops one. At least 4 heartbeat intervals (1 s).
        route_timeout_s: longest a request waits for an engine to register; None: no limit.
        max_waiting_requests: requests that may wait for an engine; more get an immediate
            :class:`WaitingQueueFullError` reply.
        request_timeout_s: longest a request may take from submit to its terminal output, else
            :class:`RequestTimeoutError`; None: no limit.
        poll_interval_s: how often the serving loop checks for stop, timeouts and heartbeats.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        keys: ControlPlaneKeys | None = None,
        prefix_weight: float = 0.0,
        prefix_block_size: int = 16,
        heartbeat_timeout_s: float | None = 30.0,
        route_timeout_s: float | None = 30.0,
        max_waiting_requests: int = 1024,
        request_timeout_s: float | None = None,
        poll_interval_s: float = 0.05,
    ):
        check_settings(heartbeat_timeout_s, route_timeout_s, max_waiting_requests, request_timeout_s)
        self.router = LoadRouter(prefix_weight, prefix_block_size)
        self.keys = keys if keys is not None else launch_keys()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.route_timeout_s = route_timeout_s
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout_s = request_timeout_s
        self.poll_interval_s = poll_interval_s
        self.protocol_errors = 0
        self.internal_errors = 0
        self.refused_submits = 0  # refused by stopping engines (and routed again)
        # A context of its own: its authentication handler answers for this socket alone.
        self._context = zmq.Context()
        self._zap = ZapHandler(self._context, self.keys)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Unbounded queues: a dropped message would lose a request's terminal reply.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self.keys.secure_server(self._socket)
        if port == 0:
            self._socket.bind_to_random_port(f"tcp://{host}")
        else:
            self._socket.bind(f"tcp://{host}:{port}")
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._requests: dict[str, _Request] = {}  # in submit order (so the oldest is first)
        self._waiting: OrderedDict[str, float] = OrderedDict()  # request id -> since when (no engine yet)
        self._last_heard: dict[bytes, float] = {}  # engines and clients
        self._clients: set[bytes] = set()
        self._next_heartbeat = 0.0
        self._engine_ids: tuple[str, ...] = ()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> InferenceCoordinator:
        """Serve in a background thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name="inference-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving: in-flight requests get an error reply, then the socket closes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        elif not self._closed:  # never served
            self._close()

    def __enter__(self) -> InferenceCoordinator:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Run the routing loop in this thread until :meth:`stop`."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._zap.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(self.poll_interval_s * 1000)))
                if self._zap.socket in ready:
                    while self._zap.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self._zap.handle()
                for _ in range(MAX_MESSAGES_PER_POLL):
                    if not self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self._receive(self._socket.recv_multipart(zmq.NOBLOCK, copy=False))
                while not self._commands.empty():
                    self._guarded(self._commands.get())
                self._guarded(self._tick)
            self._fail_all_in_flight()
        finally:
            self._close()

    def _close(self) -> None:
        self._closed = True
        self._socket.close(linger=0)
        self._zap.close()
        self._context.term()

    # -- calls from other threads ----------------------------------------------------------

    @property
    def engine_ids(self) -> tuple[str, ...]:
        """The ids of the registered engines (a snapshot; safe from any thread)."""
        return self._engine_ids

    def remove_engine(self, engine_id: str, reason: str) -> None:
        """Drop engine ``engine_id`` (e.g. its process died) as if it had gone silent; any thread."""
        self._commands.put(lambda: self._remove_engine_id(engine_id, reason))

    # -- dispatch ------------------------------------------------------------------------

    def _guarded(self, action: Callable[[], None]) -> None:
        """Run ``action``; a bug in it is logged and counted, and never stops the loop."""
        try:
            action()
        except Exception:  # noqa: BLE001 - the loop must outlive any one message
            self.internal_errors += 1
            logger.exception("the coordinator failed handling a message; it keeps serving")

    def _malformed(self, what: str) -> None:
        self.protocol_errors += 1
        logger.warning("dropped a malformed message: %s", what)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:  # [peer identity, message]
            self._malformed(f"a message is one frame, got {len(frames) - 1}")
            return
        sender, frame = frames[0].bytes, frames[1]
        try:
            role = frame.get("User-Id")  # set by the ZAP handler for every authenticated connection
        except zmq.ZMQError:
            role = None
        try:
            kind, payload = decode(frame.bytes)
        except ProtocolError as exc:
            self._malformed(str(exc))
            request_id = submitted_request_id(frame.bytes) if role == Role.CLIENT else None
            if request_id is not None:
                self._reply(sender, [error_output(request_id, error_dict(exc))])
            return
        if kind not in ACCEPTED_KINDS.get(role, ()):
            self._malformed(f"a {role} may not send {kind.value} messages")
            return
        self._last_heard[sender] = time.monotonic()
        if role == Role.CLIENT:
            self._clients.add(sender)
        handler = {
            MessageKind.SUBMIT: self._on_submit,
            MessageKind.ABORT: self._on_abort,
            MessageKind.CONTROL: self._on_control,
            MessageKind.STATS: self._on_stats,
            MessageKind.HEARTBEAT: self._on_heartbeat,
            MessageKind.REGISTER: self._on_register,
            MessageKind.DEREGISTER: self._on_deregister,
            MessageKind.ENGINE_STATS: self._on_engine_stats,
            MessageKind.OUTPUTS: self._on_outputs,
        }[kind]
        self._guarded(lambda: handler(sender, payload))

    def _send(self, identity: bytes, kind: MessageKind, **payload: Any) -> None:
        self._socket.send_multipart([identity, encode(kind, **payload)])

    def _reply(self, client: bytes, outputs: list[dict[str, Any]]) -> None:
        self._send(client, MessageKind.OUTPUTS, outputs=outputs)

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End a request here with an error reply (its routing entry, if any, ends too)."""
        request = self._requests.pop(request_id)
        self._waiting.pop(request_id, None)
        self.router.finish(request_id)
        self._reply(request.client, [error_output(request_id, error_dict(error))])

    # -- client messages -----------------------------------------------------------------

    def _on_submit(self, client: bytes, payload: dict[str, Any]) -> None:
        request_id = payload["request_id"]
        try:
            prompt_token_ids(payload["prompt_tokens"])  # routing reads token ids; no tokenizer here
        except PromptTypeError as exc:
            self._reply(client, [error_output(request_id, error_dict(exc))])
            return
        if request_id in self._requests:
            self._reply(client, [error_output(request_id, error_dict(DuplicateRequestIdError(request_id=request_id)))])
            return
        if not self.router.live_engines and len(self._waiting) >= self.max_waiting_requests:
            error = WaitingQueueFullError(
                f"no engine replica is registered and {len(self._waiting)} requests already wait for one; retry later"
            )
            self._reply(client, [error_output(request_id, error_dict(error))])
            return
        self._requests[request_id] = _Request(client, payload, time.monotonic())
        self._route(request_id)

    def _route(self, request_id: str) -> None:
        """Send a request to an engine, or let it wait for one."""
        request = self._requests[request_id]
        engine = self.router.route(request_id, request.client, request.submit["prompt_tokens"])
        if engine is None:
            self._waiting.setdefault(request_id, time.monotonic())
        else:
            self._waiting.pop(request_id, None)
            self._send(engine, MessageKind.SUBMIT, **request.submit)

    def _on_abort(self, client: bytes, payload: dict[str, Any]) -> None:
        request_id = payload["request_id"]
        request = self._requests.get(request_id)
        if request is None or request.client != client:
            return
        if request_id in self._waiting:
            del self._waiting[request_id], self._requests[request_id]
            self._reply(client, [abort_output(request_id)])
        else:
            request.aborted = True
            self._send(self.router.lookup(request_id).engine, MessageKind.ABORT, request_id=request_id)

    def _on_control(self, client: bytes, payload: dict[str, Any]) -> None:
        for engine in self.router.engines:
            self._send(engine, MessageKind.CONTROL, signal=payload["signal"])

    def _on_stats(self, client: bytes, payload: dict[str, Any]) -> None:
        self._send(client, MessageKind.STATS, query_id=payload["query_id"], stats=self.stats())

    def _on_heartbeat(self, client: bytes, payload: dict[str, Any]) -> None:
        self._send(client, MessageKind.HEARTBEAT, engines=list(self._engine_ids))

    def stats(self) -> dict[str, Any]:
        """Routing state as plain data: engines with their pending load and last engine stats,
        requests in flight and waiting for an engine, and the counters of refused messages.
        Safe from any thread: the engines are copied at once (``list`` of a dict holds the GIL
        throughout), so a replica that registers or leaves meanwhile cannot break the iteration."""
        engines = list(self.router.engines.values())
        return {
            "engines": [
                {"engine_id": load.engine_id, "pending": load.pending, "draining": load.draining, "stats": load.stats}
                for load in engines
            ],
            "in_flight": len(self.router.routes),
            "unrouted": len(self._waiting),
            "clients": len(self._clients),
            "protocol_errors": self.protocol_errors,
            "refused_submits": self.refused_submits,
            "auth_failures": self._zap.denied,
            "internal_errors": self.internal_errors,
        }

    # -- engine messages -----------------------------------------------------------------

    def _on_register(self, engine: bytes, payload: dict[str, Any]) -> None:
        engine_id = payload["engine_id"]
        for other, load in list(self.router.engines.items()):
            if load.engine_id == engine_id and other != engine:  # a restarted replica replaces its old self
                self._remove_engine(other, f"engine {engine_id} restarted before the request finished")
        self.router.register(engine, engine_id)
        self._engine_ids = tuple(load.engine_id for load in self.router.engines.values())
        for request_id in list(self._waiting):
            self._route(request_id)

    def _on_deregister(self, engine: bytes, payload: dict[str, Any]) -> None:
        self._remove_engine(engine, f"engine {payload['engine_id']} stopped before the request finished")

    def _on_engine_stats(self, engine: bytes, payload: dict[str, Any]) -> None:
        if engine not in self.router.engines:  # dropped while silent (or this coordinator is new): it is back
            logger.warning("engine %s is heard again; registering it", payload["engine_id"])
            self._on_register(engine, payload)
        self.router.engines[engine].stats = payload["stats"]

    def _on_outputs(self, engine: bytes, payload: dict[str, Any]) -> None:
        by_client: dict[bytes, list[dict[str, Any]]] = defaultdict(list)
        for output in payload["outputs"]:
            try:
                check_output(output)
            except ProtocolError as exc:
                self._malformed(f"an output of engine {self._engine_name(engine)}: {exc}")
                self._fail_malformed(engine, output, exc)
                continue
            request_id = output["request_id"]
            route = self.router.lookup(request_id)
            if route is None or route.engine != engine:
                # A request that ended here already (its engine was dropped, or it runs elsewhere now).
                if not output["finished"]:
                    self._send(engine, MessageKind.ABORT, request_id=request_id)
                continue
            if is_stopping_refusal(output):
                self._on_refusal(engine, request_id)
                continue
            self._requests[request_id].streamed = True
            if output["finished"]:
                self.router.finish(request_id)
                del self._requests[request_id]
            by_client[route.client].append(output)
        for client, outputs in by_client.items():
            self._reply(client, outputs)

    def _on_refusal(self, engine: bytes, request_id: str) -> None:
        """A stopping engine refused a submit: route nothing new to it, and run the request on a
        live engine (or answer :class:`NoEngineAvailableError` when none is left)."""
        self.refused_submits += 1
        self.router.finish(request_id)
        self.router.drain(engine)
        request = self._requests[request_id]
        if request.aborted:
            del self._requests[request_id]
            self._reply(request.client, [abort_output(request_id)])
        elif not self.router.live_engines:
            name = self._engine_name(engine)
            self._fail(
                request_id,
                NoEngineAvailableError(f"engine {name} is stopping and no other engine replica takes requests"),
            )
        else:
            self._route(request_id)

    def _fail_malformed(self, engine: bytes, output: Any, exc: ProtocolError) -> None:
        """A malformed output ends its own request (when it names one of this engine's) with an error."""
        request_id = output.get("request_id") if isinstance(output, dict) else None
        route = self.router.lookup(request_id) if isinstance(request_id, str) else None
        if route is not None and route.engine == engine:
            self._send(engine, MessageKind.ABORT, request_id=request_id)
            self._fail(request_id, MalformedOutputError(f"engine {self._engine_name(engine)} sent {exc}"))

    # -- failures ------------------------------------------------------------------------

    def _engine_name(self, engine: bytes) -> str:
        load = self.router.engines.get(engine)
        return load.engine_id if load is not None else "(unregistered)"

    def _remove_engine(self, engine: bytes, reason: str) -> None:
        self._last_heard.pop(engine, None)
        orphans = self.router.deregister(engine)
        self._engine_ids = tuple(load.engine_id for load in self.router.engines.values())
        for request_id, _ in orphans:
            request = self._requests[request_id]
            if request.aborted:
                del self._requests[request_id]
                self._reply(request.client, [abort_output(request_id)])
            elif not request.streamed and request.reruns < MAX_RERUNS:
                request.reruns += 1
                self._route(request_id)
            else:
                self._fail(request_id, EngineLostError(reason))

    def _remove_engine_id(self, engine_id: str, reason: str) -> None:
        for engine, load in list(self.router.engines.items()):
            if load.engine_id == engine_id:
                self._remove_engine(engine, f"engine {engine_id}: {reason}")

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + HEARTBEAT_INTERVAL_S
            for engine in self.router.engines:
                self._send(engine, MessageKind.HEARTBEAT)
        if self.heartbeat_timeout_s is not None:
            self._drop_silent_peers(now - self.heartbeat_timeout_s)
        if self.route_timeout_s is not None:
            deadline = now - self.route_timeout_s
            while self._waiting and next(iter(self._waiting.values())) < deadline:
                request_id = next(iter(self._waiting))
                self._fail(
                    request_id,
                    NoEngineAvailableError(f"no engine replica registered within {self.route_timeout_s}s"),
                )
        if self.request_timeout_s is not None:
            self._expire_requests(now - self.request_timeout_s)

    def _expire_requests(self, deadline: float) -> None:
        """End the requests submitted before ``deadline`` (the oldest come first) and abort them at their engines."""
        while self._requests:
            request_id, request = next(iter(self._requests.items()))
            if request.submitted_at >= deadline:
                return
            route = self.router.lookup(request_id)
            if route is not None:
                self._send(route.engine, MessageKind.ABORT, request_id=request_id)
            self._fail(request_id, RequestTimeoutError(f"the request did not finish within {self.request_timeout_s}s"))

    def _drop_silent_peers(self, deadline: float) -> None:
        for peer, heard in list(self._last_heard.items()):
            if heard >= deadline:
                continue
            if peer in self.router.engines:
                engine_id = self.router.engines[peer].engine_id
                logger.warning("engine %s silent for %.1fs; dropping it", engine_id, self.heartbeat_timeout_s)
                self._remove_engine(peer, f"engine {engine_id} went silent for {self.heartbeat_timeout_s}s")
            elif peer in self._clients:
                self._forget_client(peer)
            else:
                del self._last_heard[peer]

    def _forget_client(self, client: bytes) -> None:
        """A silent client is gone: abort its requests (their replies would reach no one)."""
        logger.warning("a client was silent for %.1fs; aborting its requests", self.heartbeat_timeout_s)
        self._clients.discard(client)
        self._last_heard.pop(client, None)
        for request_id, request in list(self._requests.items()):
            if request.client == client:
                self._on_abort(client, {"request_id": request_id})

    def _fail_all_in_flight(self) -> None:
        error = CoordinatorStoppedError("the coordinator stopped before the request finished")
        for request_id in list(self._requests):
            self._fail(request_id, error)
