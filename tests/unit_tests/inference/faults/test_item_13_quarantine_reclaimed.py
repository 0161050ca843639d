"""Issue 19, item 13: quarantined decode-side storage comes back. Pulls that failed after NIXL
finished them leave nothing quarantined (four failed pulls used to quarantine all 12 blocks and
starve the next import); pulls still pending when their request ended stay quarantined until
their (real, SIGKILLed) peer is gone, and while the quarantine is past its bound new pulls are
refused with a typed error, queued ones included, instead of waiting on it."""

import pytest

from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.handoff.decode_side import ABANDON, RELEASE, DecodeSide
from megatron.core.inference.handoff.failures import QuarantineFullError, TransferFailedError
from tests.unit_tests.inference.faults.handoff_peers import PrefillPeer, make_pulls_need_the_peer, wait_until
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    FaultyTransport,
    baseline,
    build_engine,
    build_model,
    collect,
    deliver_words,
    drain,
    nixl,
    pair,
    prefill_records,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_failed_pulls_that_ended_leave_no_quarantine_and_the_next_import_runs(pg):
    # 12 blocks; each import takes 3 (a 10-token prompt plus its first token).
    prefill, decode = pair(
        "gpt",
        pg,
        decode_overrides=dict(num_blocks=12, max_sequence_length=24),
        decode_transport=FaultyTransport("decode-faulty", poll_failures=4),
    )
    before = baseline(decode.engine)
    requests = dict(zip("abcde", prompts([10] * 5, seed=31), strict=True))
    records = prefill_records(prefill, requests)
    for request_id in "abcde":
        decode.submit(request_id, records[request_id], GREEDY)
    results = {}

    def step():
        collect(results, decode.step())
        deliver_words(decode, prefill)

    wait_until(lambda: not decode.has_unfinished_requests(), "every import ending (none starved)", poll=step)
    for request_id in "abcd":
        assert results[request_id]["terminal"] == 1
        assert isinstance(InferenceRequestError.from_dict(results[request_id]["error"]), TransferFailedError)
    assert results["e"]["terminal"] == 1 and results["e"]["finish_reason"] == "length"
    reference = run(build_engine(build_model("gpt", pg), pg), [requests["e"]], GREEDY)
    assert results["e"]["tokens"] == reference["0"]["tokens"]
    assert not decode.quarantined and baseline(decode.engine) == before
    assert decode.storage_stats()["idle"] and not prefill.pins and not prefill.quarantine


@on_single_rank
def test_pending_quarantine_is_bounded_and_comes_back_once_its_peer_is_gone(pg):
    make_pulls_need_the_peer()
    peer = PrefillPeer(pg=pg)  # forked before any NIXL agent exists here
    try:
        a, b, big, late = prompts([10, 10, 16, 9], seed=32)
        stalled = peer.prefill({"a": a, "b": b}, GREEDY)
        live, _ = pair("gpt", pg)
        # 10 blocks, refusing new pulls past 2.5 quarantined blocks.
        engine = build_engine(build_model("gpt", pg), pg, num_blocks=10, max_sequence_length=32)
        decode = DecodeSide(engine, nixl("decode"), max_quarantined_fraction=0.25)
        before = baseline(engine)
        local = prefill_records(live, {"big": big, "late": late})
        peer.stop()  # its reads cannot be answered now
        results, words = {}, []
        decode.submit("a", stalled["a"], GREEDY)
        decode.submit("b", stalled["b"], GREEDY)
        decode.submit("big", local["big"], GREEDY)  # 5 blocks: waits, a and b leave 4
        collect(results, decode.step())
        assert sorted(decode.pulling) == ["a", "b"] and [i.request_id for i in decode.waiting] == ["big"]
        decode.abort("a")
        decode.abort("b")
        collect(results, decode.step())
        words += decode.take_words()
        assert results["a"]["finish_reason"] == results["b"]["finish_reason"] == "abort"
        # The pulls still run: their 6 target blocks stay quarantined, past the bound of 2.5.
        stats = decode.storage_stats()
        assert (stats["quarantined_blocks"], stats["open_transfers"]) == (6, 2)
        assert words == [(ABANDON, "a"), (ABANDON, "b"), (RELEASE, "big")]
        live.release("big")
        error = InferenceRequestError.from_dict(results["big"]["error"])  # queued: refused, not starved
        assert isinstance(error, QuarantineFullError) and "past max_quarantined_fraction=0.25" in str(error)
        with pytest.raises(QuarantineFullError, match="6 of 10 KV blocks"):  # new pulls: refused
            decode.submit("late", local["late"], GREEDY)
        assert not decode.waiting and decode.stats["refused"] == 2

        peer.kill()  # the reads end with their peer
        wait_until(lambda: not decode.quarantined, "reclaiming the quarantine", poll=decode.step)
        words += decode.take_words()
        assert words[3:] == [(RELEASE, "a"), (RELEASE, "b")] and baseline(engine) == before
        assert decode.storage_stats()["idle"] and decode.stats["reclaimed"] == 2
        decode.submit("late", local["late"], GREEDY)  # accepted again
        drain(decode, live, results)
        assert results["late"]["finish_reason"] == "length" and decode.storage_stats()["idle"]
        assert live.storage_stats()["idle"]
    finally:
        peer.close()
