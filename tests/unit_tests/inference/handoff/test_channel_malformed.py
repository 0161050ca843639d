"""Malformed messages on the handoff channel (a real ZeroMQ socket; the prefill worker a real
process) are dropped and counted: garbage bytes, multipart frames, unknown kinds, missing or
mistyped fields, peer descriptors the transport cannot use, outputs RequestOutput does not take.
Neither end stops serving, and a prompt the worker cannot read gets one error reply."""

import msgpack
import zmq

from megatron.core.inference.coordinator.auth import Role, launch_keys
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
from tests.unit_tests.inference.faults.handoff_peers import PrefillWorkerPeer, wait_until
from tests.unit_tests.inference.handoff.common import GREEDY, build_engine, build_model, collect, nixl, prompts
from tests.unit_tests.transformer.single_rank import on_single_rank

GARBAGE = [
    [b"\xc1not msgpack"],
    [msgpack.packb(["prefill", {}]), b"second part"],
    [msgpack.packb(["no-such-kind", {}])],
    [msgpack.packb(["prefill", {"request_id": "x"}])],  # fields missing
    [msgpack.packb(["release", {"request_id": 5}])],  # a request id that is not a string
    [msgpack.packb({"kind": "stop"})],
    [b"\x92\xa4stop"],  # truncated
]


def _raw_pair(address: str | None = None) -> zmq.Socket:
    """A plain PAIR socket holding the launch's engine key pair (so the channel lets it in):
    the worker's peer when ``address`` is given, else a CURVE server in the worker's place."""
    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    if address is None:
        socket.curve_publickey, socket.curve_secretkey = launch_keys().pair(Role.ENGINE)
        socket.curve_server = True  # no authentication handler in this context: any client with the server key
        socket.bind("tcp://127.0.0.1:*")
    else:
        launch_keys().secure_engine_link(socket, server=False)
        socket.connect(address)
    return socket


def _receive(socket: zmq.Socket) -> list:
    assert socket.poll(60_000), "no reply within 60s"
    return msgpack.unpackb(socket.recv(), raw=False)


@on_single_rank
def test_the_prefill_worker_drops_malformed_messages_and_keeps_serving(pg):
    worker = PrefillWorkerPeer(pg=pg)
    socket = _raw_pair(worker.address)
    try:
        for frames in GARBAGE:
            socket.send_multipart(frames)
        socket.send(msgpack.packb(["readers", {"peers": [{"transport": "nixl"}]}]))  # not a NIXL descriptor
        unreadable = {"request_id": "unreadable", "prompt_tokens": 5, "sampling_params": {}}
        socket.send(msgpack.packb(["prefill", unreadable]))
        kind, payload = _receive(socket)
        assert (kind, payload["output"]["request_id"], payload["output"]["finish_reason"]) == (
            "finished",
            "unreadable",
            "error",
        )
        assert payload["output"]["error"]["type"] == "PromptTypeError" and payload["output"]["prompt_tokens"] == 0
        prompt = prompts([9], seed=81)[0]
        params = {"temperature": 0.0, "max_tokens": 4}
        socket.send(
            msgpack.packb(["prefill", {"request_id": "ok", "prompt_tokens": prompt, "sampling_params": params}])
        )
        kind, payload = _receive(socket)
        assert kind == "record" and payload["record"]["prompt_tokens"] == prompt
        assert worker.process.is_alive()
        socket.send(msgpack.packb(["release", {"request_id": "ok"}]))
        socket.send(msgpack.packb(["stop", {}]))
        wait_until(lambda: not worker.process.is_alive(), "the worker stopping on its stop message")
    finally:
        socket.close()
        worker.close()


@on_single_rank
def test_the_decode_front_end_drops_malformed_messages_and_keeps_serving(pg):
    socket = _raw_pair()
    decode = DecodeSide(build_engine(build_model("gpt", pg), pg), nixl("decode"))
    channel = HandoffChannel(socket.getsockopt_string(zmq.LAST_ENDPOINT), bind=False)
    engine = DisaggregatedEngine(decode, channel)
    try:
        assert _receive(socket)[0] == "readers"
        engine.add_request("r", prompts([9], seed=82)[0], GREEDY)
        assert _receive(socket)[0] == "prefill"
        for frames in GARBAGE:
            socket.send_multipart(frames)
        socket.send(msgpack.packb(["finished", {"output": {"request_id": "r"}}]))  # not a request output
        terminal = dict(
            request_id="r",
            new_token_ids=[],
            new_log_probs=[],
            new_text=None,
            finished=True,
            finish_reason="error",
            error={"type": "PrefillFailedError", "message": "m", "details": {}},
            prompt_tokens=9,
            generated_tokens=0,
        )
        socket.send(msgpack.packb(["finished", {"output": terminal | {"unknown_field": 1}}]))
        socket.send(msgpack.packb(["finished", {"output": terminal | {"prompt_log_probs": None}}]))
        results = {}
        wait_until(
            lambda: "r" in results, "the prefill worker's terminal output", poll=lambda: collect(results, engine.step())
        )
        assert results["r"]["terminal"] == 1 and results["r"]["finish_reason"] == "error"
        assert channel.num_dropped == len(GARBAGE) + 2 and not engine.has_unfinished_requests()
    finally:
        channel.close()
        socket.close()
