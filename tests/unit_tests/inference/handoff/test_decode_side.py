"""Decode side: private page initialization, suffix-only pulls, admission straight into decode,
capacity rejection and the FIFO wait (one process, NIXL between two agents)."""

import math

import pytest
import torch

from megatron.core.inference.contexts.errors import PromptExceedsStepTokenLimitError
from megatron.core.inference.engines.errors import MaxSequenceLengthOverflowError
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    block_bytes,
    build_engine,
    build_model,
    collect,
    drain,
    pair,
    prefill_records,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_continuation_pages_zeroed_imported_pages_untouched_and_cached_prefix_not_pulled(pg):
    prefill, decode = pair("gpt", pg)
    kv = decode.context.kv_cache.data
    kv[:, :, :-1] = float("nan")  # stale storage; the dummy block stays zero
    first = prompts([12], seed=3)[0]
    second = first[:8] + prompts([5], seed=4)[0]  # shares two full blocks with the first
    records = prefill_records(prefill, {"a": first})
    decode.submit("a", records["a"], GREEDY)
    decode.step()  # starts the pull
    (handle,) = decode.pulling["a"].handles
    while decode.transport.poll(handle).value == "pending":
        pass
    source_blocks = prefill.pins["a"].state.block_ids[:3]
    plan = decode.pulling["a"].plan
    pinned = prefill.engine.context.kv_cache.data
    assert torch.equal(kv[:, :, plan.block_ids], pinned[:, :, source_blocks])  # imported whole, bit for bit
    continuation = decode.context.request("a").block_ids[3]
    assert torch.equal(kv[:, :, continuation], torch.zeros_like(kv[:, :, continuation]))
    counts = decode.context.pool
    assert counts.handed_out_counts["import"] == 3 and "import" not in counts.private_page_init_counts
    assert counts.private_page_init_counts["handoff_continuation"] == 1
    assert handle.nbytes == 3 * block_bytes(decode.engine)
    results = drain(decode, prefill)
    assert results["a"]["terminal"] == 1

    records = prefill_records(prefill, {"b": second})
    decode.submit("b", records["b"], GREEDY)
    decode.step()
    imp = decode.pulling["b"]
    assert imp.plan.first_block_index == 2 and imp.plan.block_ids == decode.context.request("b").block_ids[2:4]
    cached_parent = decode.context.request("b").block_ids[1]
    assert (
        decode.context.pool.block_hash(cached_parent) == records["b"].block_hashes[1]
    )  # the pulled suffix's predecessor
    assert imp.handles[0].nbytes == 2 * block_bytes(decode.engine)  # blocks 2 (full) and 3 (partial) only
    results = drain(decode, prefill, results)
    reference = run(build_engine(build_model("gpt", pg), pg), [first, second], GREEDY)
    assert [results["a"]["tokens"], results["b"]["tokens"]] == [reference["0"]["tokens"], reference["1"]["tokens"]]
    assert not prefill.pins


@on_single_rank
def test_impossible_import_is_rejected_before_queueing_and_the_next_one_starts(pg):
    # A pool of 4 blocks of 4 tokens serves sequences of at most 16 tokens.
    prefill, decode = pair("gpt", pg, decode_overrides=dict(num_blocks=4, max_sequence_length=16))
    big, small = prompts([16, 6], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    records = prefill_records(prefill, {"big": big, "small": small}, params)
    with pytest.raises(MaxSequenceLengthOverflowError, match="exceeds the maximum sequence length 16"):
        decode.submit("big", records["big"], params)
    assert not decode.waiting and decode.transport.num_posted == 0
    prefill.release("big")  # the decode side's word for a rejected handoff
    decode.submit("small", records["small"], params)
    results = drain(decode, prefill)
    assert results["small"]["terminal"] == 1 and len(results["small"]["tokens"]) == 2
    assert decode.transport.num_posted == 1 and not prefill.pins and "big" not in results


@on_single_rank
def test_fitting_imports_wait_in_fifo_order_and_start_once_when_room_returns(pg):
    prefill, decode = pair("gpt", pg, decode_overrides=dict(num_blocks=6, max_sequence_length=24))
    local, first, second = prompts([12, 12, 3], seed=6)
    records = prefill_records(prefill, {"A": first, "B": second})
    decode.engine.add_request("local", local, SamplingParams(temperature=0.0, max_tokens=4))
    results = {}
    collect(results, decode.step())  # the local request takes 3 blocks, then grows to 4
    decode.submit("A", records["A"], GREEDY)  # needs 4 blocks: must wait
    decode.submit("B", records["B"], GREEDY)  # would fit, but waits behind A (FIFO)
    while "local" not in results or not results["local"]["terminal"]:
        assert decode.transport.num_posted == 0 and [i.request_id for i in decode.waiting] == ["A", "B"]
        collect(results, decode.step())
    assert decode.transport.num_posted == 0
    collect(results, decode.step())  # room returned: A starts, then B
    assert list(decode.pulling) == ["A", "B"] and decode.transport.num_posted == 2
    assert [len(i.handles) for i in decode.pulling.values()] == [1, 1]
    drain(decode, prefill, results)
    assert results["A"]["terminal"] == results["B"]["terminal"] == 1 and decode.transport.num_posted == 2


@on_single_rank
def test_import_over_the_step_limit_enters_decode_at_its_prompt_length(pg):
    limits = dict(max_tokens_per_step=8)
    prefill, decode = pair("gpt", pg, decode_overrides=limits)
    prompt = prompts([12], seed=7)[0]
    schedules = []
    build_step = decode.context.build_step

    def spy(schedule, **kwargs):
        schedules.append([(rid, n, decode.context.request(rid).num_computed_tokens) for rid, n in schedule])
        return build_step(schedule, **kwargs)

    decode.context.build_step = spy
    records = prefill_records(prefill, {"r": prompt})
    decode.submit("r", records["r"], GREEDY)
    results = drain(decode, prefill)
    assert schedules[0] == [("r", 1, 12)] and all(n == 1 for s in schedules for _, n, _ in s)
    assert decode.engine.stats["prefill_tokens_computed"] == 0 and len(results["r"]["tokens"]) == 6
    with pytest.raises(PromptExceedsStepTokenLimitError, match="one step processes at most 8"):
        decode.engine.add_request("plain", prompt, GREEDY)
    chunked = build_engine(build_model("gpt", pg), pg, enable_chunked_prefill=True, **limits)
    assert run(chunked, [prompt], GREEDY)["0"]["terminal"] == 1

    records = prefill_records(prefill, {"long": prompt})
    with pytest.raises(MaxSequenceLengthOverflowError, match="ask for at most 36 new tokens"):
        decode.submit("long", records["long"], SamplingParams(temperature=0.0, max_tokens=37))
    assert not decode.waiting


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@on_single_rank
def test_admitted_positions_blocks_and_mamba_slot_are_the_expected_ones(pg, kind):
    speculative = dict(num_speculative_tokens=2) if kind == "gpt" else {}
    model = dict(mtp_depths=2) if kind == "gpt" else {}
    prefill, decode = pair(kind, pg, decode_overrides=speculative, prefill_overrides=speculative, model_overrides=model)
    prompt = prompts([6], seed=8)[0]
    records = prefill_records(prefill, {"r": prompt}, SamplingParams(temperature=0.0, max_tokens=8))
    record = records["r"]
    assert len(record.resume_tokens) == (3 if kind == "gpt" else 1)
    context = decode.context
    total = len(prompt) + len(record.resume_tokens)
    expected_blocks = context.pool.peek_free(math.ceil(total / 4))
    expected_slot = context.mamba_slots._free[-1] if kind == "hybrid" else None
    decode.submit("r", record, SamplingParams(temperature=0.0, max_tokens=8))
    decode.step()
    state = context.request("r")
    assert state.block_ids == expected_blocks and state.mamba_slot == expected_slot
    assert state.num_computed_tokens == 6 and state.tokens[6:] == record.resume_tokens
    assert state.num_draft_tokens == len(record.resume_tokens) - 1
    results = drain(decode, prefill)
    reference = run(
        build_engine(build_model(kind, pg, **model), pg, **speculative),
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=8),
    )
    assert results["r"]["tokens"] == reference["0"]["tokens"]
