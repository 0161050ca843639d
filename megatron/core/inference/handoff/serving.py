"""Disaggregated serving: a prefill worker and a decode engine, talking over one channel.

:class:`HandoffChannel` carries msgpack messages over a ZeroMQ PAIR socket. The decode process
serves clients through the ordinary coordinator: :class:`DisaggregatedEngine` offers the
engine interface (``add_request`` / ``abort`` / ``step`` / ``has_unfinished_requests`` /
``pause`` / ``resume`` / ``stats``) to an unchanged
:class:`~megatron.core.inference.coordinator.EngineEndpoint`. It checks a request against the
decode engine, sends the prompt to the prefill worker, imports the handoff record that comes
back (:class:`~megatron.core.inference.handoff.decode_side.DecodeSide`) and returns every
request's outputs, so each gets exactly one terminal reply through the coordinator.
:class:`PrefillWorker` runs a :class:`~megatron.core.inference.handoff.prefill_side.PrefillSide`
in the prefill process.

A request the prefill worker does not answer for within ``prefill_timeout_s`` (a dead or stuck
worker) ends with :class:`~megatron.core.inference.handoff.failures.PrefillFailedError`, and so
does one that cannot be sent (the channel has no peer and its queue is full): sends never block.

Messages (decode -> prefill): ``readers {peers}`` (once: the transport descriptors of the decode
ranks, so the prefill side can tell when they are all gone), ``prefill {request_id,
prompt_tokens, sampling_params}``, ``abort {request_id}``, ``release {request_id}``, ``abandon
{request_id}``, ``stop {}``. (prefill -> decode): ``record {record}``, ``finished {output}``
(ended on the prefill engine). A frame that is not one of these (not msgpack, several parts, an
unknown kind, a missing field) is dropped and counted (:attr:`HandoffChannel.num_dropped`), and
so is a message whose fields its receiver cannot use: neither end stops serving over one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from megatron.core.inference.coordinator.auth import ControlPlaneKeys, Role, ZapHandler, launch_keys
from megatron.core.inference.coordinator.messages import (
    ProtocolError,
    check_output,
    sampling_params_from_dict,
    sampling_params_to_dict,
)
from megatron.core.inference.engines.requests import RequestOutput
from megatron.core.inference.errors import DuplicateRequestIdError, InferenceRequestError
from megatron.core.inference.handoff.decode_side import ABANDON, RELEASE, DecodeSide
from megatron.core.inference.handoff.failures import HandoffConfigError, PrefillFailedError
from megatron.core.inference.handoff.metadata import HandoffRecord
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.transport import TransportError
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams

logger = logging.getLogger(__name__)

# Each message kind and the fields its payload must carry.
MESSAGE_FIELDS = {
    "readers": ("peers",),
    "prefill": ("request_id", "prompt_tokens", "sampling_params"),
    "abort": ("request_id",),
    RELEASE: ("request_id",),
    ABANDON: ("request_id",),
    "stop": (),
    "record": ("record",),
    "finished": ("output",),
}
TRANSFER_POLL_S = 0.005  # how often a decode engine with nothing else to do checks its pulls


class HandoffChannel:
    """A msgpack message stream over a ZeroMQ PAIR socket (one end binds, the other connects).
    Sends never block: :meth:`send` returns False when the message cannot be queued (no peer,
    or ``max_queued`` messages already waiting for one). :meth:`receive` returns only messages
    of :data:`MESSAGE_FIELDS` (a string ``request_id`` where there is one); it drops the rest,
    counting them in ``num_dropped``.

    Authenticated and encrypted with CURVE by the engine key pair of the launch (``keys``, None:
    :func:`~megatron.core.inference.coordinator.auth.launch_keys`), as engines are on the
    control plane: the binding end answers ZeroMQ's authentication requests (in a thread of
    its own), and a peer without that key pair never gets a frame in (counted in
    ``auth_failures``)."""

    def __init__(self, address: str, *, bind: bool, keys: ControlPlaneKeys | None = None, max_queued: int = 10_000):
        keys = keys if keys is not None else launch_keys()
        self._zap: ZapHandler | None = None
        if bind:  # a context of its own: its authentication handler answers for this socket alone
            self._context = zmq.Context()
            self._zap = ZapHandler(self._context, keys, roles=frozenset({Role.ENGINE}))
            self._closing = threading.Event()
            self._zap_thread = threading.Thread(target=self._serve_zap, name="handoff-zap", daemon=True)
            self._zap_thread.start()
        else:
            self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.setsockopt(zmq.SNDHWM, max_queued)
        keys.secure_engine_link(self._socket, server=bind)
        if bind:
            if address.endswith(":0"):
                self._socket.bind_to_random_port(address.rsplit(":", 1)[0])
            else:
                self._socket.bind(address)
        else:
            self._socket.connect(address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_dropped = 0

    def send(self, kind: str, **payload: Any) -> bool:
        """Queue one message; False (nothing queued) when it cannot be queued now."""
        try:
            self._socket.send(msgpack.packb([kind, payload], use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def receive(self, timeout_ms: int = 0) -> list[tuple[str, dict[str, Any]]]:
        """Every well-formed message that arrived within ``timeout_ms`` (waits only for the first)."""
        messages = []
        while self._socket.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            message = _parse(self._socket.recv_multipart())
            if message is None:
                self.drop("a malformed frame")
            else:
                messages.append(message)
        return messages

    def drop(self, what: str) -> None:
        """Count (and log) a message that is dropped instead of served."""
        self.num_dropped += 1
        logger.warning("handoff channel %s dropped %s", self.address, what)

    @property
    def socket(self) -> zmq.Socket:
        """The underlying socket, for polling it together with others (it stays this channel's)."""
        return self._socket

    @property
    def auth_failures(self) -> int:
        """Connections refused for want of the engine key pair (on the binding end; else 0)."""
        return self._zap.denied if self._zap is not None else 0

    def _serve_zap(self) -> None:
        while not self._closing.is_set():
            if self._zap.socket.poll(50):
                self._zap.handle()

    def close(self) -> None:
        self._socket.close()
        if self._zap is not None:
            self._closing.set()
            self._zap_thread.join()
            self._zap.close()
            self._context.term()


def _parse(frames: list[bytes]) -> tuple[str, dict[str, Any]] | None:
    """``(kind, payload)`` of a one-part message of :data:`MESSAGE_FIELDS`, else None."""
    if len(frames) != 1:
        return None
    try:
        message = msgpack.unpackb(frames[0], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not (isinstance(message, list) and len(message) == 2 and isinstance(message[1], dict)):
        return None
    kind, payload = message
    fields = MESSAGE_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None or any(name not in payload for name in fields):
        return None
    if "request_id" in fields and not isinstance(payload["request_id"], str):
        return None
    return kind, payload


class PrefillWorker:
    """Serves prefill requests from one channel until told to stop (see module doc)."""

    def __init__(self, prefill: PrefillSide, channel: HandoffChannel, idle_wait_s: float = 0.005):
        self.prefill = prefill
        self.channel = channel
        self.idle_wait_s = idle_wait_s
        self.stopped = threading.Event()

    def serve_once(self) -> None:
        wait_ms = 0 if self.prefill.has_work() else int(self.idle_wait_s * 1000)
        for kind, payload in self.channel.receive(wait_ms):
            if kind == "prefill":
                self._prefill(payload)
            elif kind == "abort":
                self.prefill.abort(payload["request_id"])
            elif kind == RELEASE:
                self.prefill.release(payload["request_id"])
            elif kind == ABANDON:
                self.prefill.abandon(payload["request_id"])
            elif kind == "readers":
                try:
                    self.prefill.transport.expect_readers(payload["peers"])
                except TransportError as exc:
                    self.channel.drop(f"readers it cannot use: {exc}")
            elif kind == "stop":
                self.stopped.set()
        self.prefill.transport.serve()
        if self.prefill.has_work():
            done = self.prefill.step()
            for record in done.records:
                self.channel.send("record", record=record.to_dict())
            for output in done.finished:
                self.channel.send("finished", output=output.to_dict())
        self.prefill.expire_pins()

    def _prefill(self, payload: dict[str, Any]) -> None:
        request_id, prompt = payload["request_id"], payload["prompt_tokens"]
        try:
            self.prefill.add_request(request_id, prompt, sampling_params_from_dict(payload["sampling_params"]))
        except (ValueError, TypeError) as exc:
            error = (
                exc.to_dict()
                if isinstance(exc, InferenceRequestError)
                else {"type": type(exc).__name__, "message": str(exc), "details": {}}
            )
            prompt_length = len(prompt) if isinstance(prompt, list) else 0
            self.channel.send("finished", output=_terminal(request_id, "error", prompt_length, error).to_dict())

    def run(self) -> None:
        while not self.stopped.is_set():
            self.serve_once()


def _terminal(request_id: str, reason: str, prompt_tokens: int, error: dict | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_log_probs=[],
        new_text="",
        finished=True,
        finish_reason=reason,
        error=error,
        prompt_log_probs=None,
        prompt_tokens=prompt_tokens,
        generated_tokens=0,
    )


class DisaggregatedEngine:
    """The engine interface over a remote prefill worker and a local decode side.

    Args:
        decode: the decode side of this process.
        channel: the channel to the prefill worker (tells it the decode side's readers).
        prefill_timeout_s: how long a request may wait for the prefill worker's record.
        clock: seconds, for the timeout (monotonic by default).
    """

    def __init__(
        self,
        decode: DecodeSide,
        channel: HandoffChannel,
        *,
        prefill_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if prefill_timeout_s <= 0:
            raise HandoffConfigError(f"prefill_timeout_s must be > 0, got {prefill_timeout_s}")
        self.decode = decode
        self.engine = decode.engine
        self.channel = channel
        self.prefill_timeout_s = prefill_timeout_s
        self.clock = clock
        self._prefilling: dict[str, tuple[SamplingParams, int, float]] = {}
        self._outputs: list[RequestOutput] = []
        channel.send("readers", peers=decode.readers)

    def add_request(self, request_id: str, prompt_tokens, sampling_params: SamplingParams | None = None) -> None:
        """Check against the decode engine (typed errors; nothing sent), then send to prefill."""
        params = sampling_params or SamplingParams()
        prompt = prompt_token_ids(prompt_tokens, self.engine.tokenizer)
        if request_id in self._prefilling:
            raise DuplicateRequestIdError(request_id=request_id)
        self.engine.check_request(request_id, prompt, params, prefilled_import=True)
        self._prefilling[request_id] = (params, len(prompt), self.clock())
        sent = self.channel.send(
            "prefill", request_id=request_id, prompt_tokens=prompt, sampling_params=sampling_params_to_dict(params)
        )
        if not sent:
            self._fail_prefill(request_id, "the prefill worker cannot be reached (its channel has no room)")

    def abort(self, request_id: str) -> None:
        if request_id in self._prefilling:
            _, prompt_length, _ = self._prefilling.pop(request_id)
            self.channel.send("abort", request_id=request_id)
            self._outputs.append(_terminal(request_id, "abort", prompt_length))
        else:
            self.decode.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or quarantined storage the decode side still has to reclaim."""
        return bool(self._prefilling or self._outputs or self.decode.has_work())

    @property
    def wake_sockets(self) -> list[zmq.Socket]:
        """Sockets whose messages are worth a step: the prefill worker's channel."""
        return [self.channel.socket]

    def step_wait_s(self) -> float:
        """How long a caller may wait for a message on :attr:`wake_sockets` before the next step:
        0 while the decode engine computes or outputs are due, ``TRANSFER_POLL_S`` while only
        pulls are in flight, imports wait for room or quarantined storage waits to be reclaimed
        (transfers end without a message), else
        unbounded (only prefill records are awaited, and they arrive on the channel)."""
        if self._outputs or self.engine.has_unfinished_requests():
            return 0.0
        if self.decode.has_work():
            return TRANSFER_POLL_S
        return math.inf

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    @property
    def stats(self) -> dict[str, Any]:
        seconds = self.decode.stats["transfer_seconds"]
        return dict(
            self.engine.stats,
            **{f"handoff_{k}": v for k, v in self.decode.stats.items()},
            **{f"handoff_{k}": v for k, v in self.decode.storage_stats().items()},
            handoff_gb_per_s=self.decode.stats["transferred_bytes"] / seconds / 1e9 if seconds else 0.0,
            prefilling=len(self._prefilling),
        )

    def step(self) -> list[RequestOutput]:
        busy = self.decode.has_unfinished_requests() or self._outputs
        for kind, payload in self.channel.receive(0 if busy else 2):
            if kind == "record":
                self._on_record(payload.get("record"))
            elif kind == "finished":
                try:
                    output = RequestOutput.from_dict(check_output(payload["output"]))
                except (ProtocolError, TypeError) as exc:  # TypeError: fields RequestOutput does not take
                    self.channel.drop(f"an output it cannot use: {exc}")
                    continue
                if self._prefilling.pop(output.request_id, None) is not None:
                    self._outputs.append(output)
        deadline = self.clock() - self.prefill_timeout_s
        for request_id in [r for r, (_, _, sent_at) in self._prefilling.items() if sent_at < deadline]:
            self.channel.send("abort", request_id=request_id)  # a record that still comes is released
            self._fail_prefill(
                request_id, f"the prefill worker did not answer within prefill_timeout_s={self.prefill_timeout_s:g}"
            )
        outputs = self.decode.step()
        for word, request_id in self.decode.take_words():
            self.channel.send(word, request_id=request_id)
        taken, self._outputs = self._outputs, []
        return taken + outputs

    def _fail_prefill(self, request_id: str, reason: str) -> None:
        _, prompt_length, _ = self._prefilling.pop(request_id)
        error = PrefillFailedError(request_id=request_id, reason=reason)
        self._outputs.append(_terminal(request_id, "error", prompt_length, error.to_dict()))

    def _on_record(self, data: dict[str, Any]) -> None:
        request_id = str(data.get("request_id")) if isinstance(data, dict) else "?"
        entry = self._prefilling.pop(request_id, None)
        if entry is None:  # aborted while prefilling (or unknown): nothing will pull the pin
            self.channel.send(RELEASE, request_id=request_id)
            return
        try:
            self.decode.submit(request_id, HandoffRecord.from_dict(data), entry[0])
        except InferenceRequestError as exc:
            self.channel.send(RELEASE, request_id=request_id)
            self._outputs.append(_terminal(request_id, "error", entry[1], exc.to_dict()))
