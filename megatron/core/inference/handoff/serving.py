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

Messages (decode -> prefill): ``prefill {request_id, prompt_tokens, sampling_params}``,
``abort {request_id}``, ``release {request_id}``, ``abandon {request_id}``.
(prefill -> decode): ``record {record}``, ``finished {output}`` (ended on the prefill engine),
``stop {}``.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import zmq

from megatron.core.inference.coordinator.messages import sampling_params_from_dict, sampling_params_to_dict
from megatron.core.inference.engines.requests import RequestOutput
from megatron.core.inference.errors import DuplicateRequestIdError, InferenceRequestError
from megatron.core.inference.handoff.decode_side import ABANDON, RELEASE, DecodeSide
from megatron.core.inference.handoff.metadata import HandoffRecord
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams


class HandoffChannel:
    """A msgpack message stream over a ZeroMQ PAIR socket (one end binds, the other connects)."""

    def __init__(self, address: str, *, bind: bool):
        self._socket = zmq.Context.instance().socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 1000)
        if bind:
            if address.endswith(":0"):
                self._socket.bind_to_random_port(address.rsplit(":", 1)[0])
            else:
                self._socket.bind(address)
        else:
            self._socket.connect(address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, kind: str, **payload: Any) -> None:
        self._socket.send(msgpack.packb([kind, payload], use_bin_type=True))

    def receive(self, timeout_ms: int = 0) -> list[tuple[str, dict[str, Any]]]:
        """Every message that arrived within ``timeout_ms`` (waits only for the first)."""
        messages = []
        while self._socket.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            kind, payload = msgpack.unpackb(self._socket.recv(), raw=False)
            messages.append((kind, payload))
        return messages

    def close(self) -> None:
        self._socket.close()


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
        request_id = payload["request_id"]
        try:
            self.prefill.add_request(
                request_id, payload["prompt_tokens"], sampling_params_from_dict(payload["sampling_params"])
            )
        except (ValueError, TypeError) as exc:
            error = (
                exc.to_dict()
                if isinstance(exc, InferenceRequestError)
                else {"type": type(exc).__name__, "message": str(exc), "details": {}}
            )
            self.channel.send(
                "finished", output=_terminal(request_id, "error", len(payload["prompt_tokens"]), error).to_dict()
            )

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
    """The engine interface over a remote prefill worker and a local decode side."""

    def __init__(self, decode: DecodeSide, channel: HandoffChannel):
        self.decode = decode
        self.engine = decode.engine
        self.channel = channel
        self._prefilling: dict[str, tuple[SamplingParams, int]] = {}
        self._outputs: list[RequestOutput] = []

    def add_request(self, request_id: str, prompt_tokens, sampling_params: SamplingParams | None = None) -> None:
        """Check against the decode engine (typed errors; nothing sent), then send to prefill."""
        params = sampling_params or SamplingParams()
        prompt = prompt_token_ids(prompt_tokens, self.engine.tokenizer)
        if request_id in self._prefilling:
            raise DuplicateRequestIdError(request_id=request_id)
        self.engine.check_request(request_id, prompt, params, prefilled_import=True)
        self._prefilling[request_id] = (params, len(prompt))
        self.channel.send(
            "prefill", request_id=request_id, prompt_tokens=prompt, sampling_params=sampling_params_to_dict(params)
        )

    def abort(self, request_id: str) -> None:
        if request_id in self._prefilling:
            _, prompt_length = self._prefilling.pop(request_id)
            self.channel.send("abort", request_id=request_id)
            self._outputs.append(_terminal(request_id, "abort", prompt_length))
        else:
            self.decode.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._prefilling or self._outputs or self.decode.has_unfinished_requests())

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
            handoff_gb_per_s=self.decode.stats["transferred_bytes"] / seconds / 1e9 if seconds else 0.0,
            prefilling=len(self._prefilling),
        )

    def step(self) -> list[RequestOutput]:
        wait_ms = 0 if self.decode.has_unfinished_requests() or self._outputs else 2
        for kind, payload in self.channel.receive(wait_ms if self._prefilling else 0):
            if kind == "record":
                self._on_record(HandoffRecord.from_dict(payload["record"]))
            elif kind == "finished":
                output = RequestOutput.from_dict(payload["output"])
                if self._prefilling.pop(output.request_id, None) is not None:
                    self._outputs.append(output)
        outputs = self.decode.step()
        for word, request_id in self.decode.take_words():
            self.channel.send(word, request_id=request_id)
        taken, self._outputs = self._outputs, []
        return taken + outputs

    def _on_record(self, record: HandoffRecord) -> None:
        request_id = record.request_id
        entry = self._prefilling.pop(request_id, None)
        if entry is None:  # aborted while prefilling: nothing will pull the pin
            self.channel.send(RELEASE, request_id=request_id)
            return
        try:
            self.decode.submit(request_id, record, entry[0])
        except InferenceRequestError as exc:
            self.channel.send(RELEASE, request_id=request_id)
            self._outputs.append(_terminal(request_id, "error", entry[1], exc.to_dict()))
