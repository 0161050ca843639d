"""Issue 19, item 16: admission takes KV blocks and a Mamba slot all or nothing. With every
Mamba slot held by handoff pins (which are not requests of the context), a hybrid prefill
engine keeps the next request queued instead of raising out of its step, takes none of its
blocks, and admits it once a pin gives its slot back."""

import pytest

from megatron.core.inference.contexts import MambaSlotsExhaustedError
from megatron.core.inference.handoff.prefill_side import PrefillSide
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    baseline,
    build_engine,
    build_model,
    nixl,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_pins_holding_every_mamba_slot_leave_the_next_request_queued_with_no_blocks_taken(pg):
    engine = build_engine(build_model("hybrid", pg), pg, prefix_caching=False, max_requests=2)
    prefill = PrefillSide(engine, nixl("prefill"))
    context = engine.context
    before = baseline(engine)
    first, second, third = prompts([9, 6, 7], seed=61)
    for request_id, prompt in (("a", first), ("b", second), ("c", third)):
        prefill.add_request(request_id, prompt, GREEDY)
    records = {}
    for _ in range(6):  # a and b prefill and are pinned with both slots; c cannot start
        step = prefill.step()
        assert not step.finished
        records |= {r.request_id: r for r in step.records}
    assert sorted(records) == ["a", "b"] and context.mamba_slots.num_free_slots == 0
    assert [r.request_id for r in engine.scheduler.waiting] == ["c"] and context.num_requests == 0
    assert context.num_free_blocks == context.capacity.num_blocks - prefill.num_pinned_blocks  # nothing leaked

    free_blocks = context.num_free_blocks  # the context itself refuses, taking nothing
    with pytest.raises(MambaSlotsExhaustedError, match="needs a Mamba state slot but all 2 are held"):
        context.add_request("direct", third)
    assert context.num_free_blocks == free_blocks and context.num_requests == 0

    prefill.release("a")  # a pin gives its slot back: c is admitted and pinned
    while "c" not in records:
        records |= {r.request_id: r for r in prefill.step().records}
    reference = run(build_engine(build_model("hybrid", pg), pg), [third], GREEDY)
    assert records["c"].resume_tokens == reference["0"]["tokens"][:1]  # prefilled as one engine would
    prefill.release("b")
    prefill.release("c")
    assert baseline(engine) == before and prefill.storage_stats()["idle"]
