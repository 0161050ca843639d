"""The msgpack wire protocol between clients, the coordinator and engine endpoints.

Every message is one ZeroMQ frame holding one msgpack array ``[kind, payload]`` where
``kind`` is a :class:`MessageKind` value and ``payload`` a map whose required keys and their
types depend on the kind (:data:`PAYLOAD_TYPES`). Only msgpack is used (never pickle): a peer can send nothing but
plain data, and anything that does not decode to a well-formed message raises
:class:`ProtocolError` naming what was wrong.

Request outputs travel as the dict of ``RequestOutput.to_dict()`` (see the engine
contract); :func:`check_output` validates one on arrival.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack

from megatron.core.errors import MegatronRuntimeError
from megatron.core.inference.sampling import InvalidSamplingParamsError, SamplingParams


class ProtocolError(MegatronRuntimeError):
    """Bytes that are not a well-formed message of this protocol (a fault of the peer that sent
    them, or of the code that built them; never of a request's values, which are checked on
    their own)."""


class EngineStoppingError(MegatronRuntimeError):
    """The engine replica is stopping and takes no new request; the coordinator sends the
    request to another replica (never to a client, unless no live replica is left)."""


class MessageKind(enum.StrEnum):
    """What a message asks for or reports."""

    # client -> coordinator -> engine
    SUBMIT = "submit"  # {request_id, prompt_tokens, sampling_params}
    ABORT = "abort"  # {request_id}
    CONTROL = "control"  # {signal}: pause, resume or stop every engine
    # client <-> coordinator
    STATS = "stats"  # {query_id} -> {query_id, stats}
    # engine -> coordinator
    REGISTER = "register"  # {engine_id}
    DEREGISTER = "deregister"  # {engine_id}
    ENGINE_STATS = "engine_stats"  # {engine_id, stats}
    # engine -> coordinator -> client
    OUTPUTS = "outputs"  # {outputs: [RequestOutput dict, ...]}
    # liveness, both ways: client -> coordinator {} is answered with {engines: [engine_id, ...]};
    # coordinator -> engine {} (an engine's engine_stats are its heartbeat)
    HEARTBEAT = "heartbeat"


class ControlSignal(enum.StrEnum):
    """Signals the coordinator forwards to every engine."""

    PAUSE = "pause"
    RESUME = "resume"
    STOP = "stop"


# The keys every message of a kind must have, and their types (more keys are allowed); None: the
# receiver checks the value (a submit's prompt is a request's value: the coordinator answers a
# bad one with a PromptTypeError, see megatron.core.inference.prompts).
PAYLOAD_TYPES: dict[MessageKind, dict[str, tuple[type, ...] | None]] = {
    MessageKind.SUBMIT: {"request_id": (str,), "prompt_tokens": None, "sampling_params": (dict,)},
    MessageKind.ABORT: {"request_id": (str,)},
    MessageKind.CONTROL: {"signal": (str,)},
    MessageKind.STATS: {"query_id": (int,)},
    MessageKind.REGISTER: {"engine_id": (str,)},
    MessageKind.DEREGISTER: {"engine_id": (str,)},
    MessageKind.ENGINE_STATS: {"engine_id": (str,), "stats": (dict,)},
    MessageKind.OUTPUTS: {"outputs": (list,)},
    MessageKind.HEARTBEAT: {},
}
REQUIRED_KEYS: dict[MessageKind, tuple[str, ...]] = {kind: tuple(types) for kind, types in PAYLOAD_TYPES.items()}

# The fields of RequestOutput.to_dict() that serving reads, and their types.
OUTPUT_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "request_id": (str,),
    "new_token_ids": (list,),
    "new_log_probs": (list,),
    "new_text": (str, type(None)),
    "finished": (bool,),
    "finish_reason": (str, type(None)),
    "error": (dict, type(None)),
    "prompt_tokens": (int,),
    "generated_tokens": (int,),
}
FINISH_REASONS = ("stop", "length", "abort", "error")
# How often peers send heartbeats (and engines their stats); liveness timeouts are several of these.
HEARTBEAT_INTERVAL_S = 0.25


def encode(kind: MessageKind, **payload: Any) -> bytes:
    """Pack one message; raises :class:`ProtocolError` for a missing key or a value msgpack cannot hold."""
    missing = [key for key in REQUIRED_KEYS[kind] if key not in payload]
    if missing:
        raise ProtocolError(f"{kind.value} message needs keys {list(REQUIRED_KEYS[kind])}; missing {missing}")
    try:
        return msgpack.packb([kind.value, payload], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{kind.value} message holds a value msgpack cannot encode: {exc}") from exc


def decode(data: bytes) -> tuple[MessageKind, dict[str, Any]]:
    """Unpack one message into ``(kind, payload)``; raises :class:`ProtocolError` when malformed."""
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError(f"message is not valid msgpack: {exc}") from exc
    if not (isinstance(message, list) and len(message) == 2 and isinstance(message[1], dict)):
        raise ProtocolError(f"a message is a 2-element array [kind, payload map], got {message!r:.200}")
    try:
        kind = MessageKind(message[0])
    except ValueError:
        accepted = ", ".join(k.value for k in MessageKind)
        raise ProtocolError(f"unknown message kind {message[0]!r}; accepted: {accepted}") from None
    payload = message[1]
    missing = [key for key in REQUIRED_KEYS[kind] if key not in payload]
    if missing:
        raise ProtocolError(f"{kind.value} message needs keys {list(REQUIRED_KEYS[kind])}; missing {missing}")
    for key, types in PAYLOAD_TYPES[kind].items():
        if types is not None and (not isinstance(payload[key], types) or isinstance(payload[key], bool)):
            raise ProtocolError(f"{kind.value} message field {key!r} has type {type(payload[key]).__name__}")
    if kind is MessageKind.CONTROL and payload["signal"] not in {s.value for s in ControlSignal}:
        accepted = ", ".join(s.value for s in ControlSignal)
        raise ProtocolError(f"unknown control signal {payload['signal']!r}; accepted: {accepted}")
    return kind, payload


def submitted_request_id(data: bytes) -> str | None:
    """The request id of a malformed ``submit`` message when it has a usable one (so that the
    request still gets its one reply), else None."""
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - garbage has no request id
        return None
    if isinstance(message, list) and len(message) == 2 and message[0] == MessageKind.SUBMIT.value:
        if isinstance(message[1], dict) and isinstance(message[1].get("request_id"), str):
            return message[1]["request_id"]
    return None


def sampling_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """The msgpack-able form of ``params`` (inverse: :func:`sampling_params_from_dict`)."""
    data = dataclasses.asdict(params)
    data["stop"] = list(params.stop)
    return data


def sampling_params_from_dict(data: dict[str, Any]) -> SamplingParams:
    """Rebuild SamplingParams; unknown fields raise ``InvalidSamplingParamsError`` like bad values do."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidSamplingParamsError(f"unknown sampling parameters {unknown}; accepted: {sorted(known)}")
    return SamplingParams(**data)


def check_output(output: Any) -> dict[str, Any]:
    """Validate one request output dict as it arrives; returns it unchanged."""
    if not isinstance(output, dict):
        raise ProtocolError(f"a request output is a map, got {type(output).__name__}")
    for key, types in OUTPUT_FIELD_TYPES.items():
        if key not in output:
            raise ProtocolError(f"request output lacks {key!r}; needs {list(OUTPUT_FIELD_TYPES)}")
        if not isinstance(output[key], types):
            raise ProtocolError(f"request output field {key!r} has type {type(output[key]).__name__}")
    if not all(type(t) is int for t in output["new_token_ids"]):
        raise ProtocolError("request output field 'new_token_ids' must hold integer token ids")
    if not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in output["new_log_probs"]):
        raise ProtocolError("request output field 'new_log_probs' must hold numbers")
    if output["finished"] != (output["finish_reason"] is not None):
        raise ProtocolError("a request output has a finish_reason exactly when it is finished")
    if output["finish_reason"] is not None and output["finish_reason"] not in FINISH_REASONS:
        raise ProtocolError(f"unknown finish_reason {output['finish_reason']!r}; accepted: {FINISH_REASONS}")
    return output


def error_output(request_id: str, error: dict[str, Any], prompt_tokens: int = 0) -> dict[str, Any]:
    """The terminal output of a request that failed outside the engine's step (finish_reason "error")."""
    return {
        "request_id": request_id,
        "new_token_ids": [],
        "new_log_probs": [],
        "new_text": "",
        "finished": True,
        "finish_reason": "error",
        "error": error,
        "prompt_log_probs": None,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": 0,
    }


def is_stopping_refusal(output: dict[str, Any]) -> bool:
    """Whether ``output`` is an engine's refusal of a submit because it is stopping (see
    :class:`EngineStoppingError`): the request never started there."""
    error = output["error"]
    return (
        output["finish_reason"] == "error"
        and isinstance(error, dict)
        and error.get("type") == EngineStoppingError.__name__
    )


def abort_output(request_id: str) -> dict[str, Any]:
    """The terminal output of a request aborted before any engine took it."""
    return {**error_output(request_id, error=None), "finish_reason": "abort"}


def error_dict(exc: BaseException) -> dict[str, Any]:
    """Serialize an exception: ``exc.to_dict()`` when it has one, else ``{"type", "message", "details"}``."""
    to_dict = getattr(exc, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {"type": type(exc).__name__, "message": str(exc), "details": {}}
