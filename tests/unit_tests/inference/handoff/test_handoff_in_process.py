"""Prefill on one engine, decode on another (one process, real NIXL between two agents)."""

import dataclasses

import pytest

from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.tokenizers import ByteLevelTokenizer
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    SAMPLED,
    baseline,
    build_engine,
    build_model,
    nixl,
    prompts,
    run,
    run_handoff,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@on_single_rank
def test_prefill_then_decode_equals_one_engine(pg, kind):
    requests = prompts([6, 13, 3, 9])
    params = [GREEDY, GREEDY, dataclasses.replace(SAMPLED, top_logprobs=3), GREEDY]
    reference = run(build_engine(build_model(kind, pg), pg), requests, params)
    prefill_engine = build_engine(build_model(kind, pg), pg, prefix_caching=False)
    decode_engine = build_engine(build_model(kind, pg), pg)
    prefill = PrefillSide(prefill_engine, nixl("prefill"))
    decode = DecodeSide(decode_engine, nixl("decode"))
    before = baseline(prefill_engine), baseline(decode_engine)
    got = run_handoff(prefill, decode, requests, params)
    assert (baseline(prefill_engine), baseline(decode_engine)) == before
    for request_id, want in reference.items():
        assert got[request_id]["tokens"] == want["tokens"] and got[request_id]["terminal"] == 1
        assert got[request_id]["log_probs"] == want["log_probs"]
        assert got[request_id]["prompt_log_probs"] == want["prompt_log_probs"]
        assert got[request_id]["top_log_probs"] == want["top_log_probs"]  # the first row from the prefill side
    assert len(got["2"]["top_log_probs"]) == 6 and {len(row) for row in got["2"]["top_log_probs"]} == {3}
    assert decode_engine.stats["prefill_tokens_computed"] == 0
    assert not prefill.pins and not prefill.quarantine
    assert decode.transport.num_done == decode.transport.num_posted > 0 and decode.transport.num_failed == 0


@on_single_rank
def test_text_and_stop_sequences_continue_across_the_handoff(pg):
    # The first token is sampled on the prefill engine, the rest on the decode engine: each request's
    # text deltas, stop and token counts equal one engine's, whether a stop completes in the first
    # token, straddles the two engines, or completes later on the decode engine.
    tokenizer = ByteLevelTokenizer()

    def engine(**overrides):
        return build_engine(build_model("gpt", pg, vocab_size=128), pg, tokenizer=tokenizer, **overrides)

    requests = prompts([6, 13, 3, 9])
    plain = dataclasses.replace(GREEDY, max_tokens=12, ignore_eos=True)
    texts = [result["text"] for _, result in sorted(run(engine(), requests, plain).items())]
    stops = [texts[0][:1], texts[1][:2], texts[2][3:6], "never seen"]
    params = [dataclasses.replace(plain, stop=(stop,)) for stop in stops]
    reference = run(engine(), requests, params)
    prefill = PrefillSide(engine(prefix_caching=False), nixl("prefill"))
    got = run_handoff(prefill, DecodeSide(engine(), nixl("decode")), requests, params)
    assert got == reference
    assert [reference[str(i)]["finish_reason"] for i in range(4)] == ["stop", "stop", "stop", "length"]
    assert [reference[str(i)]["text"] for i in range(4)] == [texts[0][:0], texts[1][:0], texts[2][:3], texts[3]]
