"""Issue 19, item 2: the ZeroMQ control plane admits only the engines and clients of its launch.

A local process without the launch's keys cannot stop or pause serving, nor register as an
engine to receive prompts (its frames are refused at the CURVE handshake, before anything is
parsed); a process with a key it made itself is refused by the coordinator's authentication
handler; a client key cannot register as an engine and an engine key cannot control; key
files are private."""

import contextlib
import json
import os

import httpx
import pytest
import zmq

from megatron.core.inference import coordinator as control_plane
from megatron.core.inference.coordinator.messages import MessageKind, encode
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.coordinator.cluster import (
    peer_socket,
    run_with_client,
    running_cluster,
    wait_until,
)
from tests.unit_tests.inference.coordinator.engine_double import TOKENIZER, HashEngine, expected_tokens
from tests.unit_tests.inference.faults.serving_processes import launched

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
ATTACKS = [
    encode(MessageKind.REGISTER, engine_id="impostor"),
    encode(MessageKind.CONTROL, signal="pause"),
    encode(MessageKind.CONTROL, signal="stop"),
]


def _received_anything(socket: zmq.Socket) -> bool:
    return bool(socket.poll(0))


def test_a_process_without_the_launch_keys_can_neither_control_nor_impersonate_an_engine():
    with launched("frontend") as server:
        address = server.wait_for(r"Coordinator on (tcp://\S+)").group(1)
        url = server.wait_for_url()
        context = zmq.Context()
        try:
            impostor = context.socket(zmq.DEALER)
            impostor.connect(address)
            for message in ATTACKS:
                impostor.send(message)
            for prompt in ("one", "two", "three"):  # least-load routing would give the impostor some
                body = {"model": "megatron", "prompt": prompt, "max_tokens": 5, "temperature": 0}
                response = httpx.post(url + "/v1/completions", json=body, timeout=10)
                assert response.status_code == 200, response.text
                expected = TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize(prompt), 5))
                assert response.json()["choices"][0]["text"] == expected
            assert not _received_anything(impostor)  # no prompt reached it
        finally:
            context.destroy(linger=0)


def test_a_stranger_key_is_refused_and_each_role_may_send_only_its_own_messages():
    engine = HashEngine()
    with running_cluster([engine]) as coordinator:
        stranger = zmq.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        made_up = control_plane.ControlPlaneKeys(
            coordinator.keys.coordinator_public, engine_public=public, engine_secret=secret
        )
        made_up.secure_peer(stranger, "engine")  # knows the coordinator's public key, not a key of this launch
        stranger.connect(coordinator.address)
        with contextlib.suppress(zmq.Again):  # refused, it may have no peer to queue for: never block
            for message in ATTACKS:
                stranger.send(message, zmq.NOBLOCK)
        wait_until(lambda: coordinator.stats()["auth_failures"] >= 1, "the stranger to be refused")
        client_as_engine = peer_socket(coordinator, "client")
        client_as_engine.send(encode(MessageKind.REGISTER, engine_id="impostor"))
        engine_as_client = peer_socket(coordinator, "engine")
        engine_as_client.send(encode(MessageKind.CONTROL, signal="stop"))
        engine_as_client.send(encode(MessageKind.SUBMIT, request_id="x", prompt_tokens=[1], sampling_params={}))
        wait_until(lambda: coordinator.protocol_errors == 3, "the three out-of-role messages to be dropped")

        async def scenario(client):
            handles = [await client.submit([i], GREEDY) for i in range(4)]
            return [await h.result() for h in handles]

        results = run_with_client(coordinator, scenario)
        assert [r["finish_reason"] for r in results] == ["length"] * 4
        assert coordinator.engine_ids == ("engine-0",) and not engine.paused
        assert len(engine.finished) == 4  # every request went to the real engine
        assert not any(map(_received_anything, (stranger, client_as_engine, engine_as_client)))
        for socket in (stranger, client_as_engine, engine_as_client):
            socket.close()


def test_key_files_hold_one_role_and_must_be_private(tmp_path):
    keys = control_plane.ControlPlaneKeys.generate()
    path = keys.for_role("engine").save(str(tmp_path / "engine.json"))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(json.load(open(path))) == ["coordinator_public", "engine_public", "engine_secret"]
    loaded = control_plane.ControlPlaneKeys.load(path)
    assert loaded.pair("engine") == keys.pair("engine") and loaded.coordinator_secret is None
    with pytest.raises(control_plane.ControlPlaneKeyError, match="hold no client key pair"):
        loaded.pair("client")
    os.chmod(path, 0o644)
    private = r"is readable by other users \(mode 644\); it must be 0600"
    with pytest.raises(control_plane.ControlPlaneKeyError, match=private):
        control_plane.ControlPlaneKeys.load(path)
