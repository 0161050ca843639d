"""Issue 19, item 15: nothing abandoned is left behind. On the decode side, a pull abandoned
while pending (its request aborted; the source a real, stopped process) is polled until it
ends, then released, and its storage and the prefill pin come back. On the prefill side, a pin
that its decode peer (a real process) never spoke for is quarantined once it expires while that
peer lives, and freed once the transport finds every expected reader gone (SIGKILLed)."""

from megatron.core.inference.handoff.decode_side import ABANDON, RELEASE, DecodeSide
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.transport import NixlTransport
from tests.unit_tests.inference.faults.handoff_peers import (
    DecodePeer,
    PrefillPeer,
    make_pulls_need_the_peer,
    wait_until,
)
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    baseline,
    build_engine,
    build_model,
    collect,
    prefill_records,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_an_abandoned_pending_pull_is_polled_until_it_ends_then_released_with_its_storage(pg):
    make_pulls_need_the_peer()
    peer = PrefillPeer(pg=pg)  # forked before any NIXL agent exists here
    try:
        prompt = prompts([11], seed=51)[0]
        records = peer.prefill({"a": prompt}, GREEDY)
        engine = build_engine(build_model("gpt", pg), pg)
        decode = DecodeSide(engine, NixlTransport("decode-15"))
        before = baseline(engine)
        peer.stop()
        decode.submit("a", records["a"], GREEDY)
        results = {}
        collect(results, decode.step())
        assert "a" in decode.pulling
        decode.abort("a")
        collect(results, decode.step())
        assert results["a"]["finish_reason"] == "abort" and decode.take_words() == [(ABANDON, "a")]
        assert decode.transport.num_open == 1 and decode.quarantined[0].handles[0].state.value == "pending"

        peer.cont()  # the source answers: the abandoned read completes
        wait_until(lambda: not decode.quarantined, "reclaiming the abandoned pull", poll=decode.step)
        assert decode.transport.num_open == 0 and decode.transport.num_done == 1  # polled, then released
        assert baseline(engine) == before and decode.storage_stats()["idle"]
        words = decode.take_words()
        assert words == [(RELEASE, "a")]
        assert peer.stats()["quarantined_pins"] == 0 and peer.stats()["pins"] == 1
        peer.deliver([(ABANDON, "a"), *words])  # the words as the prefill side gets them
        assert peer.stats()["idle"]
        assert len(results["a"]["tokens"]) == 0 and results["a"]["terminal"] == 1
    finally:
        peer.close()


@on_single_rank
def test_a_pin_its_dead_decode_peer_never_spoke_for_is_freed_once_every_reader_is_gone(pg):
    reader = DecodePeer(pg=pg)  # forked before any NIXL agent exists here
    try:
        now = [0.0]
        engine = build_engine(build_model("gpt", pg), pg, prefix_caching=False)
        transport = NixlTransport("prefill-15", probe_interval_s=0.0)
        prefill = PrefillSide(engine, transport, pin_timeout_s=5.0, clock=lambda: now[0])
        before = baseline(engine)
        transport.expect_readers(reader.readers)
        served, orphaned = prompts([7, 10], seed=52)
        records = prefill_records(prefill, {"served": served, "orphaned": orphaned})
        imported = reader.import_records([records["served"]], GREEDY)  # pulled, and its word given
        for word, request_id in imported["words"]:
            (prefill.abandon if word == ABANDON else prefill.release)(request_id)
        reference = run(build_engine(build_model("gpt", pg), pg), [served], GREEDY)
        assert imported["results"]["served"]["tokens"] == reference["0"]["tokens"]
        reader.submit([records["orphaned"]], GREEDY)  # queued there, never pulled, no word

        now[0] = 6.0  # the pin expires while its reader lives: a read may come
        assert prefill.expire_pins() == ["orphaned"] and "orphaned" in prefill.quarantine
        agent = reader.readers[0]["agent"]
        wait_until(lambda: transport.reader_status() == {agent: "answered"}, "a probe answer", poll=prefill.expire_pins)
        assert "orphaned" in prefill.quarantine  # alive: still quarantined

        reader.kill()  # the reader dies without a word
        wait_until(lambda: not prefill.quarantine, "freeing the orphaned pin", poll=prefill.expire_pins)
        assert transport.reader_status() == {agent: "gone"}
        assert baseline(engine) == before and prefill.storage_stats()["idle"]
    finally:
        reader.close()
