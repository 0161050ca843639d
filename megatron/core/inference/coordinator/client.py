"""Asyncio client of the coordinator: submit requests, stream their outputs, abort them.

Every submitted request resolves: its :class:`RequestHandle` ends with exactly one terminal
output (finished, with a finish_reason), either from the engine, from the coordinator, or
from the client itself: when it is closed (an error output carrying :class:`ClientClosedError`)
or when the coordinator stops answering its heartbeats for ``heartbeat_timeout_s``
(:class:`CoordinatorLostError`). Nothing waits forever on a closed client or a dead coordinator.
:meth:`InferenceClient.health` says whether the coordinator answers and which engines it has.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from megatron.core.errors import MegatronInputError, MegatronRuntimeError
from megatron.core.inference.coordinator.auth import KEYS_ENV, ControlPlaneKeys, Role, launch_keys
from megatron.core.inference.coordinator.messages import (
    HEARTBEAT_INTERVAL_S,
    ControlSignal,
    MessageKind,
    ProtocolError,
    check_output,
    decode,
    encode,
    error_dict,
    error_output,
    sampling_params_to_dict,
)
from megatron.core.inference.errors import DuplicateRequestIdError
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams

logger = logging.getLogger(__name__)


class ClientStateError(MegatronInputError):
    """The client was used in a state that does not allow it (not started, closed, output already taken)."""


class ClientClosedError(MegatronRuntimeError):
    """The client closed while the request was in flight."""


class CoordinatorLostError(MegatronRuntimeError):
    """The coordinator stopped answering heartbeats while the request was in flight (or before it was sent)."""


@dataclass(frozen=True)
class ServingHealth:
    """What a client knows of serving: whether the coordinator answers, and its engines.

    ``problem`` is None when serving is healthy, else one line saying what is missing.
    """

    coordinator: bool
    engines: tuple[str, ...]
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None


class RequestHandle:
    """One submitted request: iterate it for its outputs, await :meth:`result` for the terminal one.

    Outputs are the dicts of ``RequestOutput.to_dict()``; the last one has ``finished`` set.
    """

    def __init__(self, request_id: str, client: InferenceClient):
        self.request_id = request_id
        self._client = client
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._result: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._exhausted = False

    @property
    def done(self) -> bool:
        return self._result.done()

    def _deliver(self, output: dict[str, Any]) -> None:
        if self._result.done():
            return  # exactly one terminal output: anything after it is dropped
        self._queue.put_nowait(output)
        if output["finished"]:
            self._result.set_result(output)

    async def result(self) -> dict[str, Any]:
        """The terminal output (always arrives; see the module docstring)."""
        return await asyncio.shield(self._result)

    def abort(self) -> None:
        """Ask the engine to end this request; its terminal output then has finish_reason "abort"."""
        self._client.abort(self.request_id)

    async def next_output(self) -> dict[str, Any]:
        """The next output; raises :class:`ClientStateError` once the terminal one was taken."""
        if self._exhausted:
            raise ClientStateError(f"request {self.request_id!r} already delivered its terminal output")
        output = await self._queue.get()
        self._exhausted = output["finished"]
        return output

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            output = await self.next_output()
            yield output
            if output["finished"]:
                return


class InferenceClient:
    """Talks to an :class:`InferenceCoordinator` from one asyncio event loop.

    Create it anywhere; call :meth:`start` inside the loop that will use it.

    Args:
        coordinator_address: the coordinator's ``tcp://host:port``.
        keys: control-plane keys holding the client key pair; None: :func:`launch_keys`.
        heartbeat_timeout_s: a coordinator silent this long is lost (see the module doc).
    """

    def __init__(
        self, coordinator_address: str, *, keys: ControlPlaneKeys | None = None, heartbeat_timeout_s: float = 30.0
    ):
        self.coordinator_address = coordinator_address
        self.keys = keys
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.protocol_errors = 0
        self._socket: zmq.asyncio.Socket | None = None
        self._handles: dict[str, RequestHandle] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._last_heard: float | None = None  # when the coordinator last answered (monotonic)
        self._since = 0.0  # start of the current wait for an answer
        self._engines: tuple[str, ...] = ()
        self._answered: asyncio.Event | None = None

    @property
    def started(self) -> bool:
        return self._socket is not None and not self._closed

    @property
    def in_flight(self) -> int:
        """Requests submitted by this client that have no terminal output yet."""
        return len(self._handles)

    async def start(self, wait_s: float = 5.0) -> InferenceClient:
        """Connect to the coordinator (in the running event loop) and wait up to ``wait_s`` for
        its first answer, so that :meth:`health` is known when this returns."""
        if self._closed:
            raise ClientStateError("this client was closed; create a new InferenceClient")
        if self._socket is None:
            keys = self.keys if self.keys is not None else launch_keys()
            self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
                self._socket.setsockopt(option, value)
            self._socket.setsockopt(zmq.ROUTING_ID, f"client-{uuid.uuid4().hex}".encode())
            keys.secure_peer(self._socket, Role.CLIENT)
            self._socket.connect(self.coordinator_address)
            self._since = time.monotonic()
            self._answered = asyncio.Event()
            self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._heartbeat_loop())]
            try:
                await asyncio.wait_for(self._answered.wait(), wait_s)
            except TimeoutError:
                logger.warning(
                    "the coordinator at %s did not answer within %.1fs (a coordinator of another launch refuses "
                    "this client's key: give it that launch's keys, e.g. through $%s)",
                    self.coordinator_address,
                    wait_s,
                    KEYS_ENV,
                )
        return self

    async def __aenter__(self) -> InferenceClient:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _require_started(self) -> zmq.asyncio.Socket:
        if not self.started:
            raise ClientStateError("the client is not started (call `await client.start()`) or already closed")
        return self._socket

    # -- liveness ------------------------------------------------------------------------

    @property
    def coordinator_alive(self) -> bool:
        """Whether the coordinator answered within the last ``heartbeat_timeout_s``."""
        return self._last_heard is not None and time.monotonic() - self._last_heard <= self.heartbeat_timeout_s

    def health(self) -> ServingHealth:
        """Whether serving can take requests: this client runs, the coordinator answers its
        heartbeats, and at least one engine is registered (as of the coordinator's last answer)."""
        alive = self.started and self.coordinator_alive
        engines = self._engines if alive else ()
        if not self.started:
            problem = "the engine client is not running"
        elif not alive:
            problem = f"the coordinator at {self.coordinator_address} is not answering"
        elif not engines:
            problem = "no engine replica is registered with the coordinator"
        else:
            problem = None
        return ServingHealth(alive, engines, problem)

    def _coordinator_lost(self) -> bool:
        """Silent past the timeout (counted from the last answer, or from when waiting began)."""
        return time.monotonic() - (self._last_heard or self._since) > self.heartbeat_timeout_s

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._socket.send(encode(MessageKind.HEARTBEAT))
            if self._handles and self._coordinator_lost():
                self._fail_in_flight(CoordinatorLostError(self.health().problem + "; the request was abandoned"))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def _fail_in_flight(self, error: BaseException) -> None:
        for request_id, handle in list(self._handles.items()):
            self.abort(request_id)  # queued: it reaches the coordinator if it comes back
            handle._deliver(error_output(request_id, error_dict(error)))
        self._handles.clear()

    # -- requests ------------------------------------------------------------------------

    async def submit(
        self, prompt_tokens: Sequence[int], sampling_params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Send a request; returns its handle at once (outputs stream into it). While the
        coordinator is lost the handle ends at once with a :class:`CoordinatorLostError` output.

        Raises, with nothing kept: ``PromptTypeError`` for anything but token ids (the client has
        no tokenizer), ``DuplicateRequestIdError``, ``ProtocolError`` for values msgpack cannot carry.
        """
        socket = self._require_started()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._handles:
            raise DuplicateRequestIdError(request_id=request_id)
        message = encode(
            MessageKind.SUBMIT,
            request_id=request_id,
            prompt_tokens=prompt_token_ids(prompt_tokens),
            sampling_params=sampling_params_to_dict(sampling_params),
        )
        handle = RequestHandle(request_id, self)
        if self._coordinator_lost():
            handle._deliver(error_output(request_id, error_dict(CoordinatorLostError(self.health().problem))))
            return handle
        self._handles[request_id] = handle
        await socket.send(message)
        return handle

    def abort(self, request_id: str) -> None:
        """Ask for a request to end; a no-op for ids that already finished.

        Synchronous on purpose: the message is queued at once (the socket has no send
        limit), so it is safe in ``finally`` blocks of cancelled tasks.
        """
        if request_id in self._handles and self.started:
            self._socket.send(encode(MessageKind.ABORT, request_id=request_id))

    async def control(self, signal: ControlSignal | str) -> None:
        """Send pause, resume or stop to every engine."""
        signal = ControlSignal(signal)
        await self._require_started().send(encode(MessageKind.CONTROL, signal=signal.value))

    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The coordinator's routing stats (engines, pending loads, engine stats, refused messages)."""
        socket = self._require_started()
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            await socket.send(encode(MessageKind.STATS, query_id=query_id))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._queries.pop(query_id, None)

    async def close(self) -> None:
        """Abort what is in flight, resolve every handle with an error output, and disconnect.

        Safe to call more than once, and whether or not the coordinator is reachable.
        """
        if self._closed:
            return
        for request_id in list(self._handles):
            self.abort(request_id)
        self._closed = True
        error = error_dict(ClientClosedError("the client closed before the request finished"))
        for request_id, handle in list(self._handles.items()):
            handle._deliver(error_output(request_id, error))
        self._handles.clear()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(ClientClosedError("the client closed before the coordinator answered"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._socket is not None:
            # A short linger lets the aborts above leave; close never blocks on it.
            self._socket.close(linger=1000)

    # -- replies -------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                self._on_message(frames)
            except ProtocolError as exc:
                self.protocol_errors += 1
                logger.warning("client dropped a malformed message: %s", exc)
            except Exception:  # noqa: BLE001 - a bad message must not end the loop (and hang every request)
                self.protocol_errors += 1
                logger.exception("client failed handling a message; it keeps receiving")

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            raise ProtocolError(f"a message is one frame, got {len(frames)}")
        kind, payload = decode(frames[0])
        self._last_heard = time.monotonic()
        if kind is MessageKind.OUTPUTS:
            for output in payload["outputs"]:
                try:
                    self._dispatch(check_output(output))
                except ProtocolError as exc:  # one bad output: the others of the batch still count
                    self.protocol_errors += 1
                    logger.warning("client dropped a malformed output: %s", exc)
        elif kind is MessageKind.STATS:
            future = self._queries.get(payload.get("query_id"))
            if future is not None and not future.done():
                future.set_result(payload.get("stats"))
        elif kind is MessageKind.HEARTBEAT:
            engines = payload.get("engines")
            self._engines = tuple(e for e in engines if isinstance(e, str)) if isinstance(engines, list) else ()
            self._answered.set()
        else:
            raise ProtocolError(f"a client does not accept {kind.value} messages")

    def _dispatch(self, output: dict[str, Any]) -> None:
        handle = self._handles.get(output["request_id"])
        if handle is None:
            return
        if output["finished"]:
            del self._handles[output["request_id"]]
        handle._deliver(output)
