"""Issue 19, item 12: NIXL's own exceptions (plain ``Exception`` subclasses such as
``nixlRemoteDisconnectError``) become TransportErrors: a prefill peer that died before or
during a pull (a real process, SIGKILLed; real NIXL over UCX loopback) ends that request with
one typed terminal error, gives its storage back, and the decode side (and the endpoint thread
serving it) keeps serving."""

import asyncio
import re
import threading

import pytest

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.failures import TransferFailedError, TransferSubmitError
from megatron.core.inference.handoff.plan import KV_REGION, Segment
from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
from megatron.core.inference.handoff.transport import TransportError
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.faults.handoff_peers import (
    PrefillPeer,
    PrefillWorkerPeer,
    make_pulls_need_the_peer,
    wait_until,
)
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    baseline,
    build_engine,
    build_model,
    collect,
    drain,
    nixl,
    pair,
    prefill_records,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

NIXL_ERROR = re.compile(r"NIXL failed [^:]+: nixl\w+Error")  # NIXL's own exception, named in the reason


@on_single_rank
def test_a_prefill_peer_killed_before_or_during_a_pull_fails_only_that_request(pg):
    make_pulls_need_the_peer()
    dead, stalled = PrefillPeer(pg=pg), PrefillPeer(pg=pg)  # forked before any NIXL agent exists here
    try:
        first, second, third = prompts([9, 7, 10], seed=21)
        records = dead.prefill({"dead": first}, GREEDY) | stalled.prefill({"stalled": second}, GREEDY)
        live, decode = pair("gpt", pg)
        before = baseline(decode.engine)
        dead.kill()
        decode.submit("dead", records["dead"], GREEDY)
        results = {}
        collect(results, decode.step())  # the pull cannot be posted: the peer is gone
        assert results["dead"]["terminal"] == 1 and results["dead"]["finish_reason"] == "error"
        error = InferenceRequestError.from_dict(results["dead"]["error"])
        assert isinstance(error, TransferSubmitError) and NIXL_ERROR.search(str(error))

        stalled.stop()  # a stopped source cannot answer a read over UCX's TCP transport
        decode.submit("stalled", records["stalled"], GREEDY)
        collect(results, decode.step())
        assert "stalled" in decode.pulling and decode.transport.num_open == 1
        stalled.kill()  # mid-transfer
        wait_until(
            lambda: "stalled" in results,
            "the failure of the stalled pull",
            poll=lambda: collect(results, decode.step()),
        )
        assert results["stalled"]["terminal"] == 1 and results["stalled"]["finish_reason"] == "error"
        error = InferenceRequestError.from_dict(results["stalled"]["error"])
        assert isinstance(error, TransferFailedError) and "nixlRemoteDisconnectError" in str(error)
        # A disconnect ends the transfer: its storage comes back at once, nothing is left open.
        assert baseline(decode.engine) == before and decode.storage_stats()["idle"]

        with pytest.raises(TransportError) as raised:  # the wrapping, seen directly: NIXL's error is the cause
            decode.transport.post_pull(
                "direct", records["dead"].sources[0].peer, [Segment(0, KV_REGION, 0, KV_REGION, 0, 8)]
            )
        cause = raised.value.__cause__
        assert type(cause).__module__.endswith("_bindings") and type(cause).__name__.startswith("nixl")

        live_records = prefill_records(live, {"live": third})
        decode.submit("live", live_records["live"], GREEDY)
        drain(decode, live, results)
        reference = run(build_engine(build_model("gpt", pg), pg), [third], GREEDY)
        assert results["live"]["tokens"] == reference["0"]["tokens"] and results["live"]["terminal"] == 1
        assert decode.storage_stats()["idle"] and not live.pins
    finally:
        dead.close()
        stalled.close()


class _KillsThePrefillWorkerOnItsFirstRecord(DisaggregatedEngine):
    def __init__(self, decode, channel, worker):
        super().__init__(decode, channel)
        self.worker = worker

    def _on_record(self, record):
        if self.worker.process.is_alive():
            self.worker.kill()  # the record arrived; its pins died with the worker
        super()._on_record(record)


@on_single_rank
def test_the_decode_endpoint_survives_a_prefill_worker_that_died_with_a_record_in_flight(pg):
    worker = PrefillWorkerPeer(pg=pg)
    coordinator = None
    try:
        decode = DecodeSide(build_engine(build_model("gpt", pg), pg), nixl("decode"))
        before = baseline(decode.engine)
        engine = _KillsThePrefillWorkerOnItsFirstRecord(decode, HandoffChannel(worker.address, bind=False), worker)
        coordinator = InferenceCoordinator().start()
        endpoint = EngineEndpoint(engine, coordinator.address)
        thread = threading.Thread(target=endpoint.run, daemon=True)
        thread.start()
        params = SamplingParams(temperature=0.0, max_tokens=4)

        async def main():
            while not coordinator.router.engines:
                await asyncio.sleep(0.01)
            async with InferenceClient(coordinator.address) as client:
                doomed = await client.submit(prompts([9], seed=22)[0], params, request_id="doomed")
                outputs = await asyncio.wait_for(_all(doomed), 30)
                too_long = await client.submit(prompts([60], seed=23)[0], params, request_id="too-long")
                return outputs, await asyncio.wait_for(too_long.result(), 30)

        outputs, rejected = asyncio.run(main())
        assert len(outputs) == 1 and outputs[0]["finished"] and outputs[0]["finish_reason"] == "error"
        assert outputs[0]["error"]["type"] == "TransferSubmitError"
        assert NIXL_ERROR.search(outputs[0]["error"]["message"])
        assert rejected["finish_reason"] == "error" and thread.is_alive()  # the endpoint still answers
        endpoint.request_stop()
        thread.join(30)
        assert not thread.is_alive() and baseline(decode.engine) == before and decode.storage_stats()["idle"]
        assert not coordinator.router.routes
    finally:
        worker.close()
        if coordinator is not None:
            coordinator.stop()


async def _all(handle):
    return [output async for output in handle]
