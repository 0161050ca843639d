"""Issue 19, item 1: no ZeroMQ message stops a receive loop.

A message that is not exactly one well-formed frame (several frames, a REQ socket's empty
delimiter, random bytes, a kind the sender may not send) is dropped and counted, or answered
when it is a submit with a usable request id; the coordinator, the engine endpoint and the
client keep serving. Unauthenticated peers (a plain DEALER, a REQ socket, 64 KiB of random
bytes over plain TCP) do not even get a frame in, and the server keeps answering over HTTP."""

import asyncio
import os
import socket
import threading
import urllib.parse

import httpx
import msgpack
import zmq

from megatron.core.inference import coordinator as control_plane
from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient
from megatron.core.inference.coordinator.messages import MessageKind, decode, encode, error_output
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.coordinator.cluster import (
    peer_socket,
    receive_command,
    run_with_client,
    running_cluster,
    wait_until,
)
from tests.unit_tests.inference.coordinator.engine_double import TOKENIZER, HashEngine, expected_tokens
from tests.unit_tests.inference.faults.serving_processes import launched

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


def _completion_text(url: str, prompt: str) -> str:
    body = {"model": "megatron", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_unauthenticated_frames_of_any_shape_never_stop_the_server():
    with launched("frontend") as server:
        address = server.wait_for(r"Coordinator on (tcp://\S+)").group(1)
        url = server.wait_for_url()
        context = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.connect(address)
            dealer.send_multipart([b"two", b"frames"])
            dealer.send(b"\x80\x04not msgpack")
            req = context.socket(zmq.REQ)  # its messages carry an empty delimiter frame
            req.connect(address)
            req.send(encode(MessageKind.STATS, query_id=1))
            parsed = urllib.parse.urlparse(address)
            with socket.create_connection((parsed.hostname, parsed.port)) as raw:
                raw.sendall(os.urandom(64 * 1024))
            for prompt in ("after garbage", "and again", "still serving"):
                assert _completion_text(url, prompt) == TOKENIZER.detokenize(
                    expected_tokens(TOKENIZER.tokenize(prompt), 5)
                )
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        finally:
            context.destroy(linger=0)


def test_authenticated_malformed_messages_are_dropped_and_counted_or_answered():
    with running_cluster([HashEngine()]) as coordinator:
        client, engine = peer_socket(coordinator, "client"), peer_socket(coordinator, "engine")
        client.send_multipart([b"two", b"frames"])
        client.send_multipart([b"", encode(MessageKind.STATS, query_id=1)])  # as a REQ socket sends
        client.send(os.urandom(64 * 1024))
        client.send(encode(MessageKind.OUTPUTS, outputs=[]))  # a client may not report outputs
        engine.send(encode(MessageKind.CONTROL, signal="stop"))  # an engine may not control
        client.send(msgpack.packb(["submit", {"request_id": "text", "prompt_tokens": [1], "sampling_params": "x"}]))
        kind, payload = receive_command(client)  # the submit that named a request id is answered
        (reply,) = payload["outputs"]
        assert (kind, reply["request_id"], reply["finish_reason"]) == (MessageKind.OUTPUTS, "text", "error")
        assert reply["error"]["type"] == "ProtocolError"
        assert reply["error"]["message"] == "submit message field 'sampling_params' has type str"
        wait_until(lambda: coordinator.protocol_errors == 6, "six malformed messages to be counted")
        client.close()
        engine.close()

        async def scenario(served):
            return await (await served.submit([1, 2], GREEDY)).result(), await served.stats()

        result, stats = run_with_client(coordinator, scenario)
        assert result["finish_reason"] == "length" and stats["engines"][0]["engine_id"] == "engine-0"
        assert (stats["protocol_errors"], stats["internal_errors"]) == (6, 0)


class _FakeCoordinator:
    """A CURVE ROUTER with its own authentication handler: the test plays the coordinator."""

    def __init__(self):
        self.keys = control_plane.ControlPlaneKeys.generate()
        self.context = zmq.Context()
        self.zap = control_plane.auth.ZapHandler(self.context, self.keys)
        self.socket = self.context.socket(zmq.ROUTER)
        self.keys.secure_server(self.socket)
        self.address = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._zap_thread = threading.Thread(target=self._answer_zap, daemon=True)
        self._zap_thread.start()

    def _answer_zap(self):
        while not self._stop.is_set():
            if self.zap.socket.poll(20):
                self.zap.handle()

    def receive(self) -> tuple[bytes, MessageKind, dict]:
        """The next message other than a heartbeat or engine stats."""
        while True:
            assert self.socket.poll(10_000), "nothing arrived"
            identity, data = self.socket.recv_multipart()
            kind, payload = decode(data)
            if kind.value not in ("heartbeat", "engine_stats"):
                return identity, kind, payload

    def close(self):
        self._stop.set()
        self._zap_thread.join()
        self.context.destroy(linger=0)


def test_the_client_and_the_engine_endpoint_survive_malformed_messages_from_their_coordinator():
    fake = _FakeCoordinator()
    endpoint = EngineEndpoint(HashEngine(), fake.address, engine_id="e", keys=fake.keys.for_role("engine"))
    thread = threading.Thread(target=endpoint.run, daemon=True)
    thread.start()
    try:
        engine, kind, _ = fake.receive()
        assert kind is MessageKind.REGISTER
        for bad in ([b"two", b"frames"], [os.urandom(1024)], [encode(MessageKind.OUTPUTS, outputs=[])]):
            fake.socket.send_multipart([engine, *bad])
        params = {"temperature": 0.0, "max_tokens": 3}
        fake.socket.send_multipart(
            [engine, encode(MessageKind.SUBMIT, request_id="r", prompt_tokens=[4], sampling_params=params)]
        )
        tokens = []
        while len(tokens) < 3:
            _, kind, payload = fake.receive()
            assert kind is MessageKind.OUTPUTS
            tokens += [t for output in payload["outputs"] for t in output["new_token_ids"]]
        assert tokens == expected_tokens([4], 3) and endpoint.protocol_errors == 3

        async def as_client():
            client = await InferenceClient(fake.address, keys=fake.keys.for_role("client")).start(wait_s=0.2)
            handle = await client.submit([5], GREEDY, request_id="c")
            identity, kind, _ = await asyncio.to_thread(fake.receive)
            assert kind is MessageKind.SUBMIT
            good = {**error_output("c", None), "finished": False, "finish_reason": None, "new_token_ids": [9]}
            good["new_log_probs"] = [0.0]
            batch = encode(MessageKind.OUTPUTS, outputs=[{"request_id": "c"}, 17, good])  # one good output of three
            for bad in ([b"two", b"frames"], [os.urandom(1024)], [encode(MessageKind.REGISTER, engine_id="x")]):
                fake.socket.send_multipart([identity, *bad])
            fake.socket.send_multipart([identity, batch])
            first = await asyncio.wait_for(handle.next_output(), 10)
            errors = client.protocol_errors
            await client.close()
            return first, errors

        first, errors = asyncio.run(as_client())
        assert first["new_token_ids"] == [9] and errors == 5
    finally:
        endpoint.request_stop()
        thread.join(10)
        fake.close()
