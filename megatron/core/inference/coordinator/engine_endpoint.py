"""The loop beside one engine replica: commands in from the coordinator, outputs back.

Each iteration the leader (rank 0 of the engine's model-parallel group) drains the
coordinator's messages into one batch of commands, every rank of the group receives that
same batch by broadcast (msgpack bytes in a uint8 tensor), applies it in the same order
(add_request / abort / pause / resume / stop) and, when there is work, every rank steps the
engine. The leader alone sends the outputs back. Since all ranks see the same commands at
the same step, their engines stay in lockstep.

The leader's socket is authenticated with the engine key pair of this launch (see
:mod:`~megatron.core.inference.coordinator.auth`). Its stats, sent every
``stats_interval_s``, are the engine's heartbeat; the coordinator sends one back as often. When
the coordinator stays silent for ``heartbeat_timeout_s`` the leader aborts every in-flight
request (no reply could reach its client) and registers again every heartbeat interval, so a
coordinator that comes back (or a new one at the same address) finds the engine. A message
that is not one well-formed frame is dropped and counted (``protocol_errors``).

Stopping (a ``stop`` signal or :meth:`EngineEndpoint.request_stop`) aborts the in-flight
requests, and the loop ends once each has its terminal output. Meanwhile a new submit is
refused with an :class:`EngineStoppingError` output, which the coordinator answers by routing
the request to another replica: a stopping engine never keeps a request waiting for its stop.

The loop blocks, never spins: with no work the leader waits up to ``idle_wait_s`` for a
message. An engine whose requests wait on peers (a disaggregated decode engine waiting for its
prefill worker or a transfer) may say so with two optional members: ``step_wait_s()``, how
long a step can wait (0: step now), and ``wake_sockets``, ZeroMQ sockets whose messages are
worth stepping for; the leader then waits on its own socket and those together.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import zmq

from megatron.core.inference.coordinator.auth import ControlPlaneKeys, Role, launch_keys
from megatron.core.inference.coordinator.messages import (
    HEARTBEAT_INTERVAL_S,
    ControlSignal,
    EngineStoppingError,
    MessageKind,
    ProtocolError,
    decode,
    encode,
    error_dict,
    error_output,
    sampling_params_from_dict,
)

logger = logging.getLogger(__name__)

Command = list  # [MessageKind value, payload]
# What an engine accepts from the coordinator (heartbeats are taken by the leader, not commands).
COMMAND_KINDS = frozenset({MessageKind.SUBMIT, MessageKind.ABORT, MessageKind.CONTROL})


class EngineEndpoint:
    """Serves one engine (``DynamicInferenceEngine`` or anything with its interface).

    Args:
        engine: the engine of this rank.
        coordinator_address: the coordinator's ``tcp://host:port`` (used by the leader only).
        engine_id: name reported to the coordinator; a random one by default.
        group: this engine's model-parallel process group, or None for a single-rank engine.
        keys: control-plane keys holding the engine key pair (leader only); None: :func:`launch_keys`.
        idle_wait_s: longest the leader waits for a message while the engine has no work;
            the group also exchanges an (empty) batch this often.
        stats_interval_s: how often the leader reports ``engine.stats`` (its heartbeat).
        heartbeat_timeout_s: a coordinator silent this long is lost (see the module doc); None: never.
    """

    def __init__(
        self,
        engine,
        coordinator_address: str | None,
        *,
        engine_id: str | None = None,
        group: dist.ProcessGroup | None = None,
        keys: ControlPlaneKeys | None = None,
        idle_wait_s: float = 0.02,
        stats_interval_s: float = HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float | None = 30.0,
    ):
        self.engine = engine
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.group = group
        self.is_leader = group is None or dist.get_rank(group) == 0
        self.idle_wait_s = idle_wait_s
        self.stats_interval_s = stats_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.protocol_errors = 0
        self.coordinator_lost = False
        self.in_flight: set[str] = set()
        self.paused = False
        self.stopping = False
        self._abort_since_step = False
        self._local_stop = threading.Event()
        self._replies: list[dict[str, Any]] = []
        self._socket = None
        self._poller = zmq.Poller()
        if self.is_leader:
            if coordinator_address is None:
                raise ValueError("the leader rank of an engine endpoint needs the coordinator address")
            self._socket = zmq.Context.instance().socket(zmq.DEALER)
            for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 2000)):
                self._socket.setsockopt(option, value)
            # One identity for this endpoint's life, kept across reconnects.
            self._socket.setsockopt(zmq.ROUTING_ID, f"{self.engine_id}/{uuid.uuid4().hex}".encode())
            (keys if keys is not None else launch_keys()).secure_peer(self._socket, Role.ENGINE)
            self._socket.connect(coordinator_address)
            for socket in (self._socket, *getattr(engine, "wake_sockets", ())):
                self._poller.register(socket, zmq.POLLIN)
            self._send(MessageKind.REGISTER, engine_id=self.engine_id)
        self._last_stats = 0.0
        self._last_heard = time.monotonic()  # from the coordinator
        self._last_register = 0.0

    def request_stop(self) -> None:
        """Ask the loop (from any thread of the leader) to stop as if the coordinator said ``stop``."""
        self._local_stop.set()

    def run(self) -> None:
        """Serve until stopped: every in-flight request gets its terminal output first."""
        try:
            while True:
                self._apply(self._exchange(self._receive() if self.is_leader else []))
                if self.stopping and not self.in_flight:
                    self._publish([])  # the refusals of this last batch go out before the deregister
                    break
                if self._has_work():
                    self._abort_since_step = False
                    self._publish([output.to_dict() for output in self.engine.step()])
                else:
                    self._publish([])
        finally:
            if self.is_leader:
                self._send(MessageKind.DEREGISTER, engine_id=self.engine_id)
                self._socket.close()

    # -- commands ------------------------------------------------------------------------

    def _has_work(self) -> bool:
        # While paused the engine is stepped only to deliver the terminal outputs of aborts.
        return self.engine.has_unfinished_requests() and (not self.paused or self._abort_since_step)

    def _wait_s(self) -> float:
        """How long the leader may wait for a message before the next step (see the module doc)."""
        if not self._has_work():
            return self.idle_wait_s
        step_wait_s = getattr(self.engine, "step_wait_s", None)
        return 0.0 if step_wait_s is None else min(self.idle_wait_s, step_wait_s())

    def _receive(self) -> list[Command]:
        commands: list[Command] = []
        if self._local_stop.is_set():
            commands.append([MessageKind.CONTROL.value, {"signal": ControlSignal.STOP.value}])
        wait_ms = 0 if commands else int(self._wait_s() * 1000)
        while self._socket in dict(self._poller.poll(wait_ms)):
            wait_ms = 0
            frames = self._socket.recv_multipart(zmq.NOBLOCK)
            try:
                if len(frames) != 1:
                    raise ProtocolError(f"a message is one frame, got {len(frames)}")
                kind, payload = decode(frames[0])
            except ProtocolError as exc:
                self.protocol_errors += 1
                logger.warning("engine %s dropped a malformed message: %s", self.engine_id, exc)
                continue
            self._heard_coordinator()
            if kind in COMMAND_KINDS:
                commands.append([kind.value, payload])
            elif kind is not MessageKind.HEARTBEAT:
                self.protocol_errors += 1
                logger.warning("engine %s dropped a %s message (not a command)", self.engine_id, kind.value)
        return commands + self._check_coordinator()

    def _heard_coordinator(self) -> None:
        self._last_heard = time.monotonic()
        if self.coordinator_lost:
            logger.warning("engine %s hears the coordinator again", self.engine_id)
            self.coordinator_lost = False

    def _check_coordinator(self) -> list[Command]:
        """When the coordinator is lost: abort every in-flight request (the commands for the
        whole group) and register again every heartbeat interval."""
        if self.heartbeat_timeout_s is None:
            return []
        now = time.monotonic()
        if self.coordinator_lost:
            if now - self._last_register >= HEARTBEAT_INTERVAL_S:
                self._last_register = now
                self._send(MessageKind.REGISTER, engine_id=self.engine_id)
            return []
        if now - self._last_heard <= self.heartbeat_timeout_s:
            return []
        logger.warning(
            "engine %s: the coordinator was silent for %.1fs; aborting %d requests",
            self.engine_id,
            self.heartbeat_timeout_s,
            len(self.in_flight),
        )
        self.coordinator_lost = True
        return [[MessageKind.ABORT.value, {"request_id": request_id}] for request_id in sorted(self.in_flight)]

    def _exchange(self, commands: list[Command]) -> list[Command]:
        """Give every rank of the group the leader's batch of commands."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return commands
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        source = dist.get_global_rank(self.group, 0)
        data = msgpack.packb(commands, use_bin_type=True) if self.is_leader else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, source, group=self.group)
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        if self.is_leader:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buffer, source, group=self.group)
        return commands if self.is_leader else msgpack.unpackb(buffer.cpu().numpy().tobytes(), raw=False)

    def _apply(self, commands: list[Command]) -> None:
        for kind, payload in commands:
            kind = MessageKind(kind)
            if kind is MessageKind.SUBMIT:
                self._add_request(payload)
            elif kind is MessageKind.ABORT:
                if payload["request_id"] in self.in_flight:
                    self.engine.abort(payload["request_id"])
                    self._abort_since_step = True
            elif kind is MessageKind.CONTROL:
                self._control(ControlSignal(payload["signal"]))
            else:
                logger.warning("engine %s ignored a %s message", self.engine_id, kind.value)

    def _add_request(self, payload: dict[str, Any]) -> None:
        request_id = payload["request_id"]
        if self.stopping:  # the coordinator sends it to another replica
            error = EngineStoppingError(f"engine {self.engine_id} is stopping and takes no new requests")
            self._replies.append(error_output(request_id, error_dict(error)))
            return
        try:
            params = sampling_params_from_dict(payload["sampling_params"])
            self.engine.add_request(request_id, list(payload["prompt_tokens"]), params)
        except (ValueError, TypeError) as exc:  # typed admission errors are ValueErrors
            self._replies.append(error_output(request_id, error_dict(exc), prompt_tokens=len(payload["prompt_tokens"])))
            return
        self.in_flight.add(request_id)

    def _control(self, signal: ControlSignal) -> None:
        if signal is ControlSignal.PAUSE and not self.paused:
            self.engine.pause()
            self.paused = True
        elif signal is ControlSignal.RESUME and self.paused:
            self.engine.resume()
            self.paused = False
        elif signal is ControlSignal.STOP and not self.stopping:
            self.stopping = True
            for request_id in sorted(self.in_flight):
                self.engine.abort(request_id)
            self._control(ControlSignal.RESUME)

    # -- replies -------------------------------------------------------------------------

    def _publish(self, outputs: list[dict[str, Any]]) -> None:
        for output in outputs:
            if output["finished"]:
                self.in_flight.discard(output["request_id"])
        if not self.is_leader:
            self._replies.clear()
            return
        outputs = self._replies + outputs
        self._replies = []
        if outputs:
            self._send(MessageKind.OUTPUTS, outputs=outputs)
        now = time.monotonic()
        if now - self._last_stats >= self.stats_interval_s:
            self._last_stats = now
            stats = _plain_stats(getattr(self.engine, "stats", {}))
            self._send(MessageKind.ENGINE_STATS, engine_id=self.engine_id, stats=stats)

    def _send(self, kind: MessageKind, **payload: Any) -> None:
        self._socket.send(encode(kind, **payload))


def _plain_stats(stats: dict) -> dict[str, Any]:
    """The scalar entries of an engine's stats (what msgpack and Prometheus can carry)."""
    return {str(k): v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}
