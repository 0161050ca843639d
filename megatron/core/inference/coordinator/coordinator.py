"""The coordinator: one ZeroMQ ROUTER socket between clients and data-parallel engine replicas.

Clients and engine endpoints connect DEALER sockets to it. Engines announce themselves
with a ``register`` message; everyone else is a client. A client's ``submit`` goes to the
engine with the least pending load (see :class:`LoadRouter`), its ``abort`` follows the
request to that engine, and ``control`` signals go to every engine. Engine ``outputs`` go
back to the client that submitted each request; a terminal output ends the request's
routing entry. Every request gets exactly one terminal reply: from its engine, or from
the coordinator when the request is aborted before reaching one, when its engine leaves
or falls silent, or when the coordinator stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from typing import Any

import zmq

from megatron.core.errors import MegatronRuntimeError
from megatron.core.inference.coordinator.messages import (
    ControlSignal,
    MessageKind,
    ProtocolError,
    abort_output,
    check_output,
    decode,
    encode,
    error_dict,
    error_output,
)
from megatron.core.inference.coordinator.routing import LoadRouter
from megatron.core.inference.errors import DuplicateRequestIdError
from megatron.core.inference.prompts import PromptTypeError, prompt_token_ids

logger = logging.getLogger(__name__)


class EngineLostError(MegatronRuntimeError):
    """The engine serving a request left or went silent before the request finished."""


class CoordinatorStoppedError(MegatronRuntimeError):
    """The coordinator stopped while the request was in flight."""


class InferenceCoordinator:
    """Routes requests between clients and engine replicas over one ROUTER socket.

    Args:
        host: interface to bind (loopback unless told otherwise).
        port: TCP port; 0 picks a free one (see :attr:`address`).
        prefix_weight, prefix_block_size: prefix-aware scoring (see :class:`LoadRouter`).
        engine_timeout_s: an engine silent for this long (it sends stats every few tenths of
            a second) is dropped and its requests get an error reply; None never drops one.
        poll_interval_s: how often the serving loop checks for stop and silent engines.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        prefix_weight: float = 0.0,
        prefix_block_size: int = 16,
        engine_timeout_s: float | None = 30.0,
        poll_interval_s: float = 0.05,
    ):
        self.router = LoadRouter(prefix_weight, prefix_block_size)
        self.engine_timeout_s = engine_timeout_s
        self.poll_interval_s = poll_interval_s
        self.protocol_errors = 0
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Unbounded queues: a dropped message would lose a request's terminal reply.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        if port == 0:
            self._socket.bind_to_random_port(f"tcp://{host}")
        else:
            self._socket.bind(f"tcp://{host}:{port}")
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # Requests that arrived while no engine was registered, in arrival order.
        self._unrouted: OrderedDict[str, tuple[bytes, dict[str, Any]]] = OrderedDict()
        self._last_heard: dict[bytes, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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

    def __enter__(self) -> InferenceCoordinator:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Run the routing loop in this thread until :meth:`stop`."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(int(self.poll_interval_s * 1000)):
                    while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        sender, data = self._socket.recv_multipart(zmq.NOBLOCK)
                        self._handle(sender, data)
                self._drop_silent_engines()
            self._fail_all_in_flight()
        finally:
            self._socket.close(linger=0)

    # -- dispatch ------------------------------------------------------------------------

    def _handle(self, sender: bytes, data: bytes) -> None:
        try:
            kind, payload = decode(data)
        except ProtocolError as exc:
            self.protocol_errors += 1
            logger.warning("dropped a malformed message: %s", exc)
            return
        if sender in self.router.engines:
            self._last_heard[sender] = time.monotonic()
        handler = {
            MessageKind.SUBMIT: self._on_submit,
            MessageKind.ABORT: self._on_abort,
            MessageKind.CONTROL: self._on_control,
            MessageKind.STATS: self._on_stats,
            MessageKind.REGISTER: self._on_register,
            MessageKind.DEREGISTER: self._on_deregister,
            MessageKind.ENGINE_STATS: self._on_engine_stats,
            MessageKind.OUTPUTS: self._on_outputs,
        }[kind]
        try:
            handler(sender, payload)
        except (ProtocolError, TypeError, ValueError) as exc:
            self.protocol_errors += 1
            logger.warning("rejected a %s message: %s", kind.value, exc)

    def _send(self, identity: bytes, kind: MessageKind, **payload: Any) -> None:
        self._socket.send_multipart([identity, encode(kind, **payload)])

    def _reply(self, client: bytes, outputs: list[dict[str, Any]]) -> None:
        self._send(client, MessageKind.OUTPUTS, outputs=outputs)

    # -- client messages -----------------------------------------------------------------

    def _on_submit(self, client: bytes, payload: dict[str, Any]) -> None:
        request_id = payload["request_id"]
        if not isinstance(request_id, str):
            raise ProtocolError("submit needs a string request_id")
        try:
            prompt_token_ids(payload["prompt_tokens"])  # routing reads token ids; no tokenizer here
        except PromptTypeError as exc:
            self._reply(client, [error_output(request_id, error_dict(exc))])
            return
        if request_id in self._unrouted:
            self._reply(client, [error_output(request_id, error_dict(DuplicateRequestIdError(request_id=request_id)))])
            return
        try:
            engine = self.router.route(request_id, client, payload["prompt_tokens"])
        except DuplicateRequestIdError as exc:
            self._reply(client, [error_output(request_id, error_dict(exc))])
            return
        if engine is None:
            self._unrouted[request_id] = (client, payload)
        else:
            self._send(engine, MessageKind.SUBMIT, **payload)

    def _on_abort(self, client: bytes, payload: dict[str, Any]) -> None:
        request_id = payload["request_id"]
        queued = self._unrouted.get(request_id)
        if queued is not None and queued[0] == client:
            del self._unrouted[request_id]
            self._reply(client, [abort_output(request_id)])
            return
        route = self.router.lookup(request_id)
        if route is not None and route.client == client:
            self._send(route.engine, MessageKind.ABORT, request_id=request_id)

    def _on_control(self, client: bytes, payload: dict[str, Any]) -> None:
        signal = ControlSignal(payload["signal"])
        for engine in self.router.engines:
            self._send(engine, MessageKind.CONTROL, signal=signal.value)

    def _on_stats(self, client: bytes, payload: dict[str, Any]) -> None:
        self._send(client, MessageKind.STATS, query_id=payload["query_id"], stats=self.stats())

    def stats(self) -> dict[str, Any]:
        """Routing state as plain data: engines with their pending load and last engine stats."""
        return {
            "engines": [
                {"engine_id": load.engine_id, "pending": load.pending, "stats": load.stats}
                for load in self.router.engines.values()
            ],
            "in_flight": len(self.router.routes),
            "unrouted": len(self._unrouted),
            "protocol_errors": self.protocol_errors,
        }

    # -- engine messages -----------------------------------------------------------------

    def _on_register(self, engine: bytes, payload: dict[str, Any]) -> None:
        self.router.register(engine, str(payload["engine_id"]))
        self._last_heard[engine] = time.monotonic()
        unrouted, self._unrouted = self._unrouted, OrderedDict()
        for client, submit in unrouted.values():
            self._on_submit(client, submit)

    def _on_deregister(self, engine: bytes, payload: dict[str, Any]) -> None:
        self._remove_engine(engine, f"engine {payload['engine_id']} stopped before the request finished")

    def _on_engine_stats(self, engine: bytes, payload: dict[str, Any]) -> None:
        if engine in self.router.engines and isinstance(payload["stats"], dict):
            self.router.engines[engine].stats = payload["stats"]

    def _on_outputs(self, engine: bytes, payload: dict[str, Any]) -> None:
        by_client: dict[bytes, list[dict[str, Any]]] = defaultdict(list)
        for output in payload["outputs"]:
            check_output(output)
            route = self.router.lookup(output["request_id"])
            if route is None or route.engine != engine:
                continue  # a late output of a request already ended here
            if output["finished"]:
                self.router.finish(output["request_id"])
            by_client[route.client].append(output)
        for client, outputs in by_client.items():
            self._reply(client, outputs)

    # -- failures ------------------------------------------------------------------------

    def _remove_engine(self, engine: bytes, reason: str) -> None:
        self._last_heard.pop(engine, None)
        by_client: dict[bytes, list[dict[str, Any]]] = defaultdict(list)
        for request_id, route in self.router.deregister(engine):
            by_client[route.client].append(error_output(request_id, error_dict(EngineLostError(reason))))
        for client, outputs in by_client.items():
            self._reply(client, outputs)

    def _drop_silent_engines(self) -> None:
        if self.engine_timeout_s is None:
            return
        deadline = time.monotonic() - self.engine_timeout_s
        for engine, heard in list(self._last_heard.items()):
            if heard < deadline:
                engine_id = self.router.engines[engine].engine_id
                logger.warning("engine %s silent for %.1fs; dropping it", engine_id, self.engine_timeout_s)
                self._remove_engine(engine, f"engine {engine_id} went silent for {self.engine_timeout_s}s")

    def _fail_all_in_flight(self) -> None:
        error = error_dict(CoordinatorStoppedError("the coordinator stopped before the request finished"))
        by_client: dict[bytes, list[dict[str, Any]]] = defaultdict(list)
        for request_id, route in list(self.router.routes.items()):
            self.router.finish(request_id)
            by_client[route.client].append(error_output(request_id, error))
        for request_id, (client, _) in self._unrouted.items():
            by_client[client].append(error_output(request_id, error))
        self._unrouted.clear()
        for client, outputs in by_client.items():
            self._reply(client, outputs)
