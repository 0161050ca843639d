"""Issue 19, item 14: timeouts on the prefill side and on pulls. A request whose prefill
worker died (a real process, SIGKILLed) gets one typed error reply through the coordinator
after ``prefill_timeout_s``; a pull from a stopped peer (real NIXL over UCX's TCP transport)
fails after ``pull_timeout_s``; aborting a pending pull gives its terminal reply at the next
step, while its storage stays quarantined until the transport says the pull ended."""

import asyncio
import threading

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.failures import PrefillFailedError, TransferFailedError
from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
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
    nixl,
    prompts,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_a_request_whose_prefill_worker_died_gets_one_error_reply_after_the_prefill_timeout(pg):
    worker = PrefillWorkerPeer(pg=pg)
    coordinator = None
    try:
        worker.kill()  # before it answered anything
        decode = DecodeSide(build_engine(build_model("gpt", pg), pg), nixl("decode"))
        engine = DisaggregatedEngine(decode, HandoffChannel(worker.address, bind=False), prefill_timeout_s=0.5)
        coordinator = InferenceCoordinator().start()
        endpoint = EngineEndpoint(engine, coordinator.address)
        thread = threading.Thread(target=endpoint.run, daemon=True)
        thread.start()

        async def main():
            while not coordinator.router.engines:
                await asyncio.sleep(0.01)
            async with InferenceClient(coordinator.address) as client:
                handle = await client.submit(prompts([9], seed=41)[0], SamplingParams(max_tokens=3), request_id="r")
                return await asyncio.wait_for(_all(handle), 30)

        outputs = asyncio.run(main())
        assert len(outputs) == 1 and outputs[0]["finished"] and outputs[0]["finish_reason"] == "error"
        error = InferenceRequestError.from_dict(outputs[0]["error"])
        assert error == PrefillFailedError(
            request_id="r", reason="the prefill worker did not answer within prefill_timeout_s=0.5"
        )
        assert engine.stats["prefilling"] == 0 and not coordinator.router.routes
        endpoint.request_stop()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        worker.close()
        if coordinator is not None:
            coordinator.stop()


@on_single_rank
def test_an_aborted_or_timed_out_pending_pull_ends_at_once_and_its_storage_waits_for_the_transport(pg):
    make_pulls_need_the_peer()
    peer = PrefillPeer(pg=pg)  # forked before any NIXL agent exists here
    try:
        records = peer.prefill(dict(zip(("aborted", "timed-out"), prompts([9, 6], seed=42), strict=True)), GREEDY)
        now = [0.0]
        engine = build_engine(build_model("gpt", pg), pg)
        decode = DecodeSide(engine, nixl("decode"), pull_timeout_s=5.0, clock=lambda: now[0])
        before = baseline(engine)
        peer.stop()  # its reads cannot be answered now
        for request_id, record in records.items():
            decode.submit(request_id, record, GREEDY)
        results = {}
        collect(results, decode.step())
        assert sorted(decode.pulling) == ["aborted", "timed-out"] and not results

        decode.abort("aborted")
        collect(results, decode.step())  # the next step answers, though the pull still runs
        assert results["aborted"]["terminal"] == 1 and results["aborted"]["finish_reason"] == "abort"
        assert "timed-out" not in results and decode.quarantined[0].request_id == "aborted"

        now[0] = 5.5  # past pull_timeout_s
        collect(results, decode.step())
        assert results["timed-out"]["terminal"] == 1 and results["timed-out"]["finish_reason"] == "error"
        assert InferenceRequestError.from_dict(results["timed-out"]["error"]) == TransferFailedError(
            request_id="timed-out", transport="nixl", reason="no answer within pull_timeout_s=5"
        )
        stats = decode.storage_stats()  # both pulls may still write: their targets stay out of use
        assert (stats["quarantined_imports"], stats["quarantined_blocks"], stats["open_transfers"]) == (2, 5, 2)
        assert not decode.has_unfinished_requests() and decode.has_work()

        peer.kill()
        wait_until(lambda: not decode.quarantined, "reclaiming after the peer died", poll=decode.step)
        assert baseline(engine) == before and decode.storage_stats()["idle"]
        assert decode.stats["timed_out"] == 1 and decode.stats["aborted"] == 1
    finally:
        peer.close()


async def _all(handle):
    return [output async for output in handle]
