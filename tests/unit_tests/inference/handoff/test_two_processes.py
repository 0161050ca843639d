"""A prefill engine and a decode engine in two processes, over NIXL or torch.distributed:
outputs equal one engine's, the decode engine prefills nothing, a corrupted block changes the
output, the bytes moved are exactly the KV + Mamba bytes, and both sides end at baseline."""

import math

import pytest
import torch.distributed as dist

from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.metadata import HandoffRecord
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.transport import TorchDistributedTransport, shared_store
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    SAMPLED,
    baseline,
    block_bytes,
    build_engine,
    build_model,
    collect,
    nixl,
    prompts,
    run,
)
from tests.unit_tests.models.hybrid.common import collection

REQUESTS = prompts([6, 13, 3, 9]) + prompts([13])[:1]
REQUESTS[4] = list(REQUESTS[1])  # "4" repeats "1"; its last (partial) block is corrupted in transit
PARAMS = [GREEDY, GREEDY, SAMPLED, GREEDY, GREEDY]


def _transport(kind: str, role: str, store):
    return nixl(role) if kind == "nixl" else TorchDistributedTransport(store, clients=[1] if role == "prefill" else [])


def _prefill_rank(model_kind: str, transport_kind: str, pg, store):
    engine = build_engine(build_model(model_kind, pg), pg, prefix_caching=False)
    before = baseline(engine)
    prefill = PrefillSide(engine, _transport(transport_kind, "prefill", store))
    for index, prompt in enumerate(REQUESTS):
        prefill.add_request(str(index), prompt, PARAMS[index])
    records = []
    while prefill.has_work():
        records += prefill.step().records
    corrupted = next(r for r in records if r.request_id == "4").block_ids[-1]
    engine.context.kv_cache.data[:, :, corrupted] += 3.0
    box = [[r.to_dict() for r in records]]
    dist.broadcast_object_list(box, src=0)
    while not store.check(["decode_done"]):  # NIXL needs nothing from here; torch.distributed pulls are served
        prefill.transport.serve()
    words = [None]
    dist.broadcast_object_list(words, src=1)
    for word, request_id in words[0]:
        (prefill.abandon if word == "abandon" else prefill.release)(request_id)
    return dict(baseline_kept=baseline(engine) == before, pins=len(prefill.pins) + len(prefill.quarantine))


def _decode_rank(model_kind: str, transport_kind: str, pg, store):
    reference = run(build_engine(build_model(model_kind, pg), pg), REQUESTS, PARAMS)
    engine = build_engine(build_model(model_kind, pg), pg)
    before = baseline(engine)
    decode = DecodeSide(engine, _transport(transport_kind, "decode", store))
    box = [None]
    dist.broadcast_object_list(box, src=0)
    results, words = {}, []
    for data in box[0]:
        record = HandoffRecord.from_dict(data)
        decode.submit(record.request_id, record, PARAMS[int(record.request_id)])
    while decode.has_unfinished_requests():
        collect(results, decode.step())
        words += decode.take_words()
    store.set("decode_done", b"1")
    dist.broadcast_object_list([words], src=1)
    expected_bytes = sum(math.ceil(len(p) / 4) for p in REQUESTS) * block_bytes(engine)
    if engine.context.mamba_slots is not None:
        slots = engine.context.mamba_slots
        per_request = (slots.conv[:, 0].numel() + slots.ssm[:, 0].numel()) * slots.conv.element_size()
        expected_bytes += len(REQUESTS) * per_request
    transport = decode.transport
    return dict(
        reference=reference,
        results=results,
        prefill_tokens=engine.stats["prefill_tokens_computed"],
        transferred=decode.stats["transferred_bytes"],
        expected_bytes=expected_bytes,
        posted=transport.num_posted,
        done=transport.num_done,
        failed=transport.num_failed,
        baseline_kept=baseline(engine) == before,
        quarantined=len(decode.quarantined),
    )


def _handoff(model_kind: str, transport_kind: str):
    pg, store = collection(), shared_store()
    return (_prefill_rank if dist.get_rank() == 0 else _decode_rank)(model_kind, transport_kind, pg, store)


@pytest.mark.parametrize("transport_kind", ["nixl", "torch"])
@pytest.mark.parametrize("model_kind", ["gpt", "hybrid"])
def test_two_process_handoff_equals_one_engine(model_kind, transport_kind):
    prefill, decode = run_distributed(_handoff, 2, model_kind, transport_kind)
    reference, results = decode["reference"], decode["results"]
    for request_id in ("0", "1", "2", "3"):
        got, want = results[request_id], reference[request_id]
        assert got["terminal"] == 1 and got["tokens"] == want["tokens"] and got["log_probs"] == want["log_probs"]
        assert got["prompt_log_probs"] == want["prompt_log_probs"]
    corrupted, clean = results["4"], reference["1"]
    assert (corrupted["tokens"], corrupted["log_probs"]) != (clean["tokens"], clean["log_probs"])
    assert decode["prefill_tokens"] == 0
    assert decode["transferred"] == decode["expected_bytes"]
    assert decode["posted"] == decode["done"] == len(REQUESTS) and decode["failed"] == 0
    assert decode["baseline_kept"] and decode["quarantined"] == 0
    assert prefill == dict(baseline_kept=True, pins=0)
