"""The handoff channel is authenticated like the control plane (CURVE, the launch's engine key
pair), through real sockets: a prefill worker's channel lets in only a peer holding that pair
(not a plain ZeroMQ peer, not one of another launch, not a client of this launch, not raw TCP
bytes), none of the others' frames ever arrives, and the real peer's do; a decode end does
not talk to an impostor worker without the pair."""

import socket
import urllib.parse

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron.core.inference.coordinator.auth import ControlPlaneKeys, Role
from megatron.core.inference.handoff.serving import HandoffChannel

TIMEOUT_S = 30.0


class _HandshakeFailures:
    """The handshake failures of a bound channel, read from its socket's monitor."""

    def __init__(self, channel: HandoffChannel):
        events = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._monitor = channel.socket.get_monitor_socket(events | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def wait_for(self, *events: zmq.Event) -> None:
        """Read failures until one of ``events`` arrives (the ones before it are from earlier peers)."""
        seen: list[zmq.Event] = []
        while not seen or seen[-1] not in events:
            names = " or ".join(event.name for event in events)
            assert self._monitor.poll(int(TIMEOUT_S * 1000)), f"no {names} within {TIMEOUT_S}s; saw {seen}"
            seen.append(zmq.Event(recv_monitor_message(self._monitor)["event"]))

    def close(self) -> None:
        self._monitor.close(linger=0)


def _raw_pair(address: str, curve: tuple[bytes, bytes, bytes] | None = None) -> zmq.Socket:
    """A PAIR peer of ``address`` that makes one handshake (no reconnects, so one failure event),
    as a CURVE client with ``curve`` = (public, secret, server public) keys, or plain without."""
    peer = zmq.Context.instance().socket(zmq.PAIR)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RECONNECT_IVL, -1)
    if curve is not None:
        peer.curve_publickey, peer.curve_secretkey, peer.curve_serverkey = curve
    peer.connect(address)
    return peer


def _offer(peer: zmq.Socket, frame: bytes) -> None:
    """Queue ``frame`` on ``peer`` if its pipe is up; never wait (a peer whose one handshake
    already failed has no pipe, and a PAIR send would then block for good)."""
    try:
        peer.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _receive_one(channel: HandoffChannel) -> list:
    messages = []
    while not messages:
        received = channel.receive(int(TIMEOUT_S * 1000))
        assert received, f"nothing arrived within {TIMEOUT_S}s"
        messages += received
    return messages


def test_only_a_holder_of_the_engine_key_pair_gets_a_frame_through():
    launch = ControlPlaneKeys.generate()
    worker = HandoffChannel("tcp://127.0.0.1:0", bind=True, keys=launch.for_role(Role.ENGINE))
    failures = _HandshakeFailures(worker)
    stop = msgpack.packb(["stop", {}])
    try:
        plain = _raw_pair(worker.address)  # no CURVE at all
        _offer(plain, stop)
        # which end notices the mechanism mismatch first is a race: the worker's end reports it
        # as a protocol failure, or the plain peer's hang-up as one without detail
        failures.wait_for(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        plain.close()

        stranger = HandoffChannel(worker.address, bind=False, keys=ControlPlaneKeys.generate().for_role(Role.ENGINE))
        assert stranger.send("stop")  # queued: it never gets through the handshake
        failures.wait_for(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        stranger.close()

        client = _raw_pair(worker.address, (*launch.pair(Role.CLIENT), launch.engine_public))  # this launch, wrong role
        _offer(client, stop)
        failures.wait_for(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        client.close()
        assert worker.auth_failures == 1

        parsed = urllib.parse.urlparse(worker.address)
        with socket.create_connection((parsed.hostname, parsed.port)) as raw:
            raw.sendall(b"\xff" * 4096)
        failures.wait_for(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

        decode = HandoffChannel(worker.address, bind=False, keys=launch.for_role(Role.ENGINE))
        try:
            assert decode.send("abort", request_id="r")
            assert _receive_one(worker) == [("abort", {"request_id": "r"})]
            assert worker.send("release", request_id="r")
            assert _receive_one(decode) == [("release", {"request_id": "r"})]
        finally:
            decode.close()
        assert worker.num_dropped == 0 and worker.receive(0) == []  # no stranger's "stop", ever
    finally:
        failures.close()
        worker.close()


def test_a_decode_end_does_not_talk_to_an_impostor_worker():
    launch = ControlPlaneKeys.generate()
    impostor = HandoffChannel("tcp://127.0.0.1:0", bind=True, keys=ControlPlaneKeys.generate().for_role(Role.ENGINE))
    failures = _HandshakeFailures(impostor)
    decode = HandoffChannel(impostor.address, bind=False, keys=launch.for_role(Role.ENGINE))
    try:
        assert decode.send("prefill", request_id="r", prompt_tokens=[1, 2], sampling_params={})
        failures.wait_for(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)  # the decode end expects this launch's key
        assert impostor.receive(0) == [] and impostor.num_dropped == 0
    finally:
        decode.close()
        failures.close()
        impostor.close()
