"""Asyncio client of the coordinator: submit requests, stream their outputs, abort them.

Every submitted request resolves: its :class:`RequestHandle` ends with exactly one terminal
output (finished, with a finish_reason), either from the engine, from the coordinator, or
from the client itself when it is closed (an error output carrying
:class:`ClientClosedError`). Nothing waits forever on a closed client.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from megatron.core.errors import MegatronInputError, MegatronRuntimeError
from megatron.core.inference.coordinator.messages import (
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
    """

    def __init__(self, coordinator_address: str):
        self.coordinator_address = coordinator_address
        self._socket: zmq.asyncio.Socket | None = None
        self._handles: dict[str, RequestHandle] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._receiver: asyncio.Task | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        return self._socket is not None and not self._closed

    @property
    def in_flight(self) -> int:
        """Requests submitted by this client that have no terminal output yet."""
        return len(self._handles)

    async def start(self) -> InferenceClient:
        """Connect to the coordinator (in the running event loop)."""
        if self._closed:
            raise ClientStateError("this client was closed; create a new InferenceClient")
        if self._socket is None:
            self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
                self._socket.setsockopt(option, value)
            self._socket.connect(self.coordinator_address)
            self._receiver = asyncio.create_task(self._receive_loop())
        return self

    async def __aenter__(self) -> InferenceClient:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _require_started(self) -> zmq.asyncio.Socket:
        if not self.started:
            raise ClientStateError("the client is not started (call `await client.start()`) or already closed")
        return self._socket

    async def submit(
        self, prompt_tokens: Sequence[int], sampling_params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Send a request; returns its handle at once (outputs stream into it).

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
        """The coordinator's routing stats (engines, pending loads, engine stats)."""
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
        if self._receiver is not None:
            self._receiver.cancel()
            try:
                await self._receiver
            except asyncio.CancelledError:
                pass
        if self._socket is not None:
            # A short linger lets the aborts above leave; close never blocks on it.
            self._socket.close(linger=1000)

    async def _receive_loop(self) -> None:
        while True:
            data = await self._socket.recv()
            try:
                kind, payload = decode(data)
                if kind is MessageKind.OUTPUTS:
                    for output in payload["outputs"]:
                        self._dispatch(check_output(output))
                elif kind is MessageKind.STATS:
                    future = self._queries.get(payload["query_id"])
                    if future is not None and not future.done():
                        future.set_result(payload["stats"])
                else:
                    raise ProtocolError(f"a client does not accept {kind.value} messages")
            except ProtocolError as exc:
                logger.warning("client dropped a malformed message: %s", exc)

    def _dispatch(self, output: dict[str, Any]) -> None:
        handle = self._handles.get(output["request_id"])
        if handle is None:
            return
        if output["finished"]:
            del self._handles[output["request_id"]]
        handle._deliver(output)
