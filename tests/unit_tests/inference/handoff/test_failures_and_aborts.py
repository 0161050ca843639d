"""Transfer failures (injected through a transport wrapper), aborts in every state, and pins
abandoned past their timeout."""

import pytest

from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.handoff.failures import TransferFailedError, TransferSubmitError
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.transport import NixlTransport, TorchDistributedTransport, shared_store
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    FaultyTransport,
    baseline,
    build_engine,
    build_model,
    collect,
    deliver_words,
    drain,
    pair,
    prefill_records,
    prompts,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@on_single_rank
def test_submission_failure_releases_everything_once_and_the_next_request_completes(pg, kind):
    prefill, decode = pair(kind, pg, decode_transport=FaultyTransport("decode-faulty", post_failures=2))
    before = baseline(decode.engine), baseline(prefill.engine)
    first, second, third = prompts([9, 7, 5], seed=9)
    records = prefill_records(prefill, {"a": first, "b": second, "c": third})
    decode.submit("a", records["a"], GREEDY)
    results = {}
    collect(results, decode.step())  # the pull cannot start
    assert results["a"]["finish_reason"] == "error" and results["a"]["terminal"] == 1
    assert InferenceRequestError.from_dict(results["a"]["error"]) == TransferSubmitError(
        request_id="a", transport="nixl", reason="injected: the peer refused the connection"
    )
    assert baseline(decode.engine) == before[0] and not decode.quarantined  # released exactly once
    decode.submit("b", records["b"], GREEDY)
    with pytest.raises(TransferSubmitError, match="injected"):  # a direct caller gets the exception
        decode.start(decode.waiting.popleft())
    collect(results, decode.step())
    assert results["b"]["terminal"] == 1 and results["b"]["finish_reason"] == "error"
    deliver_words(decode, prefill)
    decode.submit("c", records["c"], GREEDY)
    drain(decode, prefill, results)
    assert results["c"]["finish_reason"] == "length" and len(results["c"]["tokens"]) == 6
    assert baseline(decode.engine) == before[0] and baseline(prefill.engine) == before[1]
    assert not prefill.pins and not prefill.quarantine


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@on_single_rank
def test_peer_failure_ends_the_request_and_gives_its_storage_back_once_the_pull_ended(pg, kind):
    prefill, decode = pair(kind, pg, decode_transport=FaultyTransport("decode-faulty", poll_failures=1))
    before = baseline(decode.engine)
    first, second = prompts([10, 6], seed=10)
    records = prefill_records(prefill, {"a": first, "b": second})
    decode.submit("a", records["a"], GREEDY)
    results = drain(decode, prefill)
    assert results["a"]["terminal"] == 1 and results["a"]["finish_reason"] == "error"
    assert InferenceRequestError.from_dict(results["a"]["error"]) == TransferFailedError(
        request_id="a", transport="nixl", reason="injected: the peer reported an error"
    )
    # The failed pull had ended (NIXL finished it), so nothing can write its targets any more.
    assert not decode.quarantined and baseline(decode.engine) == before and decode.stats["reclaimed"] == 1
    assert decode.transport.num_open == 0 and decode.storage_stats()["idle"]
    assert "a" not in prefill.pins and "a" not in prefill.quarantine  # told to release, never to abandon
    decode.submit("b", records["b"], GREEDY)
    drain(decode, prefill, results)
    assert results["b"]["finish_reason"] == "length" and not prefill.pins


@on_single_rank
def test_aborts_in_every_state_end_the_request_without_stray_pulls_or_steps(pg):
    prefill, decode = pair("gpt", pg, decode_overrides=dict(num_blocks=6, max_sequence_length=24))
    before = baseline(decode.engine)
    scheduled = []
    build_step = decode.context.build_step
    decode.context.build_step = lambda schedule, **kw: (
        scheduled.extend(r for r, _ in schedule),
        build_step(schedule, **kw),
    )[1]
    local, queued, pulling, admitted = prompts([12, 12, 5, 5], seed=11)
    records = prefill_records(prefill, {"queued": queued, "pulling": pulling, "admitted": admitted})
    results = {}
    decode.engine.add_request("local", local, SamplingParams(temperature=0.0, max_tokens=4))
    collect(results, decode.step())
    decode.submit("queued", records["queued"], GREEDY)  # waits for room
    collect(results, decode.step())
    decode.abort("queued")  # before capacity admission
    collect(results, decode.step())
    assert results["queued"] == dict(results["queued"], terminal=1, finish_reason="abort", tokens=[])
    drain(decode, prefill, results)
    assert decode.transport.num_posted == 0

    decode.submit("pulling", records["pulling"], GREEDY)
    collect(results, decode.step())  # the pull starts
    assert "pulling" in decode.pulling
    decode.abort("pulling")  # during the transfer
    decode.submit("admitted", records["admitted"], GREEDY)
    while "admitted" not in results:  # until it decoded a step
        collect(results, decode.step())
    decode.abort("admitted")
    drain(decode, prefill, results)
    for request_id in ("queued", "pulling", "admitted"):
        assert results[request_id]["terminal"] == 1 and results[request_id]["finish_reason"] == "abort"
    assert "pulling" not in scheduled and "queued" not in scheduled and "admitted" in scheduled
    assert decode.transport.num_posted == decode.transport.num_done == 2  # no stray pull
    assert baseline(decode.engine) == before and not prefill.pins and not prefill.quarantine


@on_single_rank
def test_abandoned_pins_are_quarantined_while_a_read_may_run_and_released_otherwise(pg):
    now = [0.0]
    engine = build_engine(build_model("gpt", pg), pg, prefix_caching=False)
    free_blocks = engine.context.num_free_blocks
    one_sided = PrefillSide(engine, NixlTransport("prefill-timeout"), pin_timeout_s=5.0, clock=lambda: now[0])
    records = prefill_records(one_sided, {"a": prompts([9])[0]})
    now[0] = 4.0
    assert one_sided.expire_pins() == [] and "a" in one_sided.pins
    now[0] = 6.0
    assert one_sided.expire_pins() == ["a"]  # NIXL reads are one-sided: a read may be in flight
    assert "a" in one_sided.quarantine and engine.context.num_free_blocks == free_blocks - 3
    one_sided.release("a")  # the late word frees it
    assert engine.context.num_free_blocks == free_blocks and not one_sided.quarantine

    other = build_engine(build_model("gpt", pg), pg, prefix_caching=False)
    served = PrefillSide(other, TorchDistributedTransport(shared_store()), pin_timeout_s=5.0, clock=lambda: now[0])
    prefill_records(served, {"b": prompts([9])[0]})
    now[0] = 12.0
    assert served.expire_pins() == ["b"]  # this transport knows no read of it is in flight
    assert not served.pins and not served.quarantine and other.context.num_free_blocks == free_blocks
    assert records["a"].block_ids
