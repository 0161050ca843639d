"""Issue 19, item 17: a record the decode side cannot plan its pulls for (a KV head dim or a
Mamba state shape that differs from its own) is rejected with a typed error at submission,
before anything is queued or pulled; the decode side, and the serving front end around it,
go on serving (real NIXL between two agents)."""

import pytest

from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.handoff.decode_side import RELEASE, DecodeSide
from megatron.core.inference.handoff.failures import HandoffMetadataError
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.serving import DisaggregatedEngine, HandoffChannel
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
)
from tests.unit_tests.transformer.single_rank import on_single_rank

MISMATCHES = {
    "gpt": (dict(kv_channels=16), "head_dim", "prefill has 16, this engine 8; both sides must match"),
    # conv (d_inner + 2 groups x d_state, d_conv - 1) = (64 + 4 x d_state, 3); ssm (heads, head dim, d_state)
    "hybrid": (
        dict(mamba_state_dim=16),
        "mamba",
        "prefill state shapes (128, 3), (8, 8, 16) differ from (96, 3), (8, 8, 8)",
    ),
}


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@on_single_rank
def test_a_record_that_cannot_be_planned_is_rejected_before_queueing_and_serving_goes_on(pg, kind):
    overrides, field, problem = MISMATCHES[kind]
    other = PrefillSide(
        build_engine(build_model(kind, pg, **overrides), pg, prefix_caching=False), nixl("prefill-other")
    )
    prefill, decode = pair(kind, pg)
    before = baseline(decode.engine)
    bad, good = prompts([9, 7], seed=71)
    mismatched = prefill_records(other, {"bad": bad})["bad"]
    with pytest.raises(HandoffMetadataError) as raised:
        decode.submit("bad", mismatched, GREEDY)
    assert raised.value == HandoffMetadataError(request_id="bad", field=field, problem=problem)
    assert not decode.waiting and decode.transport.num_posted == 0 and decode.stats["rejected"] == 1
    decode.submit("good", prefill_records(prefill, {"good": good})["good"], GREEDY)
    results = drain(decode, prefill)
    assert results["good"]["finish_reason"] == "length" and baseline(decode.engine) == before
    other.release("bad")  # the word a rejected handoff gets


@on_single_rank
def test_the_serving_front_end_answers_an_unplannable_record_with_one_error_and_a_release(pg):
    other = PrefillSide(
        build_engine(build_model("gpt", pg, kv_channels=16), pg, prefix_caching=False), nixl("prefill-other")
    )
    decode = DecodeSide(build_engine(build_model("gpt", pg), pg), nixl("decode"))
    prefill_end = HandoffChannel("tcp://127.0.0.1:0", bind=True)
    engine = DisaggregatedEngine(decode, HandoffChannel(prefill_end.address, bind=False))
    prompt = prompts([9], seed=72)[0]
    engine.add_request("r", prompt, GREEDY)
    record = prefill_records(other, {"r": prompt})["r"]
    results, messages = {}, []
    # The worker answers the engine's "prefill" message: the channel is connected by then (a send
    # to a peer still in its handshake is not queued), as a real prefill worker's answer would be.
    while "prefill" not in messages:
        collect(results, engine.step())
        messages += [kind for kind, _ in prefill_end.receive(10)]
    assert prefill_end.send("record", record=record.to_dict())
    while "r" not in results:
        collect(results, engine.step())
    assert results["r"]["terminal"] == 1 and results["r"]["finish_reason"] == "error"
    error = InferenceRequestError.from_dict(results["r"]["error"])
    assert isinstance(error, HandoffMetadataError) and error.details["field"] == "head_dim"
    messages += [kind for kind, _ in prefill_end.receive(1000)]
    while RELEASE not in messages:
        messages += [kind for kind, _ in prefill_end.receive(1000)]
    assert messages == ["readers", "prefill", RELEASE] and not engine.has_unfinished_requests()
    prefill_end.close()
    engine.channel.close()
