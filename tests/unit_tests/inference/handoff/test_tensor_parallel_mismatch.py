"""TP1 prefill -> TP2 decode: each decode rank pulls its KV head range from a TP1 prefill
engine in the other process, and the two-rank decode gives the tokens of one engine."""

import torch.distributed as dist

from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.metadata import HandoffRecord
from megatron.core.inference.handoff.prefill_side import PrefillSide
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.inference.handoff.common import GREEDY, build_engine, build_model, collect, nixl, prompts, run
from tests.unit_tests.models.hybrid.common import collection

REQUESTS = prompts([6, 13, 9], seed=12)


def _tp1_to_tp2():
    rank = dist.get_rank()
    single, pair = collection(tp=1), collection(tp=2)
    reference = run(build_engine(build_model("gpt", single), single), REQUESTS, GREEDY) if rank == 0 else None
    prefill = PrefillSide(build_engine(build_model("gpt", single), single, prefix_caching=False), nixl("prefill"))
    decode_engine = build_engine(build_model("gpt", pair, tp=2), pair)
    decode = DecodeSide(decode_engine, nixl("decode"), group=pair.tp)
    for index, prompt in enumerate(REQUESTS):
        prefill.add_request(str(index), prompt, GREEDY)
    records = []
    while prefill.has_work():
        records += [r.to_dict() for r in prefill.step().records]
    everyone = [None, None]
    dist.all_gather_object(everyone, records)
    for data in everyone[1 - rank]:  # pull from the other process's prefill engine
        record = HandoffRecord.from_dict(data)
        decode.submit(record.request_id, record, GREEDY)
    results, words = {}, []
    while decode.has_unfinished_requests():
        collect(results, decode.step())
        words += decode.take_words()
    dist.barrier()  # the other rank's pulls from this rank's pins ended
    heads = {record["sources"][0]["kv_head_stop"] for record in records}
    return dict(
        reference=reference,
        results=results,
        words=len(words),
        local_heads=decode.layout.num_local_heads,
        source_heads=heads,
        bytes=decode.stats["transferred_bytes"],
    )


def test_tp1_prefill_feeds_a_tp2_decode_engine():
    ranks = run_distributed(_tp1_to_tp2, 2)
    reference = ranks[0]["reference"]
    for result in ranks:
        assert result["local_heads"] == 1 and result["source_heads"] == {2}  # each decode rank: 1 of 2 KV heads
        assert result["words"] == len(REQUESTS)
        for request_id, want in reference.items():
            assert result["results"][request_id]["tokens"] == want["tokens"]
            assert result["results"][request_id]["terminal"] == 1
    assert ranks[0]["bytes"] == ranks[1]["bytes"] > 0
