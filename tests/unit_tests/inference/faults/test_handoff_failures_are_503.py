"""Found by the soak test: a request whose disaggregated replica could not move its KV (its
prefill worker was killed, a transfer failed) was answered 400 ``invalid_request``, as if the
client had sent something wrong. It is 503 ``unavailable``: the request was fine, the server
could not serve it then."""

import threading

import httpx

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.errors import RequestFailedError
from megatron.core.inference.handoff import failures
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
from megatron.core.inference.server import ServerThread, service
from tests.unit_tests.inference.coordinator.engine_double import TOKENIZER
from tests.unit_tests.inference.faults.handoff_peers import PrefillWorkerPeer, wait_until
from tests.unit_tests.inference.handoff.common import build_engine, build_model, nixl
from tests.unit_tests.transformer.single_rank import on_single_rank


def test_every_handoff_failure_is_answered_as_unavailable():
    handoff_failures = {
        name
        for name, value in vars(failures).items()
        if isinstance(value, type) and issubclass(value, RequestFailedError) and value.__module__ == failures.__name__
    }
    assert handoff_failures == service._HANDOFF_FAILED
    for name in handoff_failures:
        error = service.error_from_output({"type": name, "message": "m"})
        assert (error.status, error.code) == (503, "unavailable")


@on_single_rank
def test_a_request_whose_prefill_worker_was_killed_gets_503_over_http(pg):
    worker = PrefillWorkerPeer(pg=pg)  # forked before NIXL or ZeroMQ exist here
    coordinator = InferenceCoordinator().start()
    server = None
    try:
        worker.kill()
        decode = DecodeSide(build_engine(build_model("gpt", pg), pg), nixl("decode"))
        engine = DisaggregatedEngine(decode, HandoffChannel(worker.address, bind=False), prefill_timeout_s=0.5)
        endpoint = EngineEndpoint(engine, coordinator.address, engine_id="decode")
        thread = threading.Thread(target=endpoint.run, daemon=True)
        thread.start()
        wait_until(lambda: coordinator.engine_ids == ("decode",), "the decode replica to register")
        server = ServerThread(InferenceClient(coordinator.address), tokenizer=TOKENIZER).start()
        body = {"model": "megatron", "prompt": [5, 6, 7], "max_tokens": 3}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "unavailable" and error["type"] == "server_error"
        assert error["message"].endswith("failed: the prefill worker did not answer within prefill_timeout_s=0.5")
        endpoint.request_stop()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        if server is not None:
            server.stop()
        coordinator.stop()
        worker.close()
