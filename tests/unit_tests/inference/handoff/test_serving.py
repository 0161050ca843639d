"""Disaggregated serving behind the coordinator: a prefill worker and a decode engine (threads
here, processes in the example) serve streaming and non-streaming clients; string and token
prompts; an injected transfer failure gives one FAILED reply and clears routing once."""

import asyncio
import threading

from megatron.core.inference.coordinator import EngineEndpoint, InferenceClient, InferenceCoordinator
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel, PrefillWorker
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from tests.unit_tests.inference.handoff.common import FaultyTransport, baseline, build_engine, build_model, nixl
from tests.unit_tests.transformer.single_rank import on_single_rank

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _serve(pg, decode_transport):
    model = dict(vocab_size=260)  # byte-level ids
    prefill = PrefillSide(build_engine(build_model("gpt", pg, **model), pg, prefix_caching=False), nixl("prefill"))
    decode = DecodeSide(build_engine(build_model("gpt", pg, **model), pg), decode_transport)
    prefill_end = HandoffChannel("tcp://127.0.0.1:0", bind=True)
    decode_end = HandoffChannel(prefill_end.address, bind=False)
    coordinator = InferenceCoordinator().start()
    worker = PrefillWorker(prefill, prefill_end)
    endpoint = EngineEndpoint(DisaggregatedEngine(decode, decode_end), coordinator.address)
    threads = [threading.Thread(target=worker.run, daemon=True), threading.Thread(target=endpoint.run, daemon=True)]
    for thread in threads:
        thread.start()

    def stop():
        endpoint.request_stop()
        worker.stopped.set()
        for thread in threads:
            thread.join(30)
        coordinator.stop()

    return prefill, decode, coordinator, stop


async def _wait_registered(coordinator):
    while not coordinator.router.engines:
        await asyncio.sleep(0.01)


@on_single_rank
def test_string_and_token_prompts_through_streaming_and_plain_clients(pg):
    tokenizer = ByteLevelTokenizer()
    text_ids = prompt_token_ids("hello handoff", tokenizer, add_bos=True)
    assert text_ids == [tokenizer.bos] + list(b"hello handoff")  # one BOS when asked
    assert prompt_token_ids(text_ids, tokenizer, add_bos=True) == text_ids  # token lists are used as given
    assert prompt_token_ids("hello handoff", tokenizer) == list(b"hello handoff")
    prefill, decode, coordinator, stop = _serve(pg, nixl("decode"))
    before = baseline(decode.engine)

    async def main():
        await _wait_registered(coordinator)
        async with InferenceClient(coordinator.address) as client:
            streamed = await client.submit(text_ids, PARAMS)
            chunks = [output async for output in streamed]
            plain = await (await client.submit(list(text_ids), PARAMS)).result()
            return chunks, plain

    try:
        chunks, plain = asyncio.run(main())
    finally:
        stop()
    streamed_tokens = [t for c in chunks for t in c["new_token_ids"]]
    assert chunks[-1]["finished"] and len(chunks) > 1 and len(streamed_tokens) == 5
    assert plain["finish_reason"] == "length" and plain["prompt_tokens"] == chunks[-1]["prompt_tokens"] == 14
    assert plain["generated_tokens"] == 5
    assert decode.engine.stats["prefill_tokens_computed"] == 0 and baseline(decode.engine) == before
    assert not prefill.pins and not prefill.quarantine and not coordinator.router.routes


@on_single_rank
def test_transfer_failure_is_one_failed_reply_and_serving_continues(pg):
    prefill, decode, coordinator, stop = _serve(pg, FaultyTransport("decode-faulty", post_failures=1))
    loads = []

    async def main():
        await _wait_registered(coordinator)
        async with InferenceClient(coordinator.address) as client:
            failed = await client.submit([1, 2, 3, 4, 5, 6], PARAMS, request_id="fails")
            outputs = [output async for output in failed]
            loads.append((dict(coordinator.router.routes), [e.pending for e in coordinator.router.engines.values()]))
            later = await (await client.submit([7, 8, 9], PARAMS, request_id="later")).result()
            return outputs, later

    try:
        outputs, later = asyncio.run(main())
    finally:
        stop()
    assert len(outputs) == 1 and outputs[0]["finish_reason"] == "error"
    assert outputs[0]["error"]["type"] == "TransferSubmitError" and "injected" in outputs[0]["error"]["message"]
    assert loads == [({}, [0])]
    coordinator.router.check_invariants()
    assert later["finish_reason"] == "length" and later["generated_tokens"] == 5
    assert not prefill.pins and not decode.quarantined
