"""Sentinel tests: with the whole KV buffer poisoned with NaN, every page that becomes private
to a request (on each path) is zero before its first write; cached, shared, imported and
unrelated pages keep their bytes."""

import pytest
import torch

from megatron.core.inference.contexts import Capacity, DynamicInferenceContext, PageReason, StageCacheSpec

BS = 4


def make_context(num_blocks=12):
    spec = StageCacheSpec((1, 2), (), num_kv_heads=2, head_dim=3, block_size=BS)
    return DynamicInferenceContext(
        spec,
        Capacity(num_blocks=num_blocks, max_requests=8),
        max_sequence_length=64,
        max_tokens_per_step=64,
        enable_prefix_caching=True,
    )


def fill_step_kv(ctx, value=1.0):
    """Run the attention hook of every layer with finite K/V, as a model forward would."""
    batch = ctx.step
    t = batch.num_padded_tokens
    for layer in ctx.spec.attention_layer_numbers:
        q = torch.full((t, 1, 2, 3), value)
        ctx.store_kv_and_attend(layer, q, q.clone(), q.clone())


def prefill(ctx, request_id):
    state = ctx.request(request_id)
    ctx.build_step([(request_id, len(state.tokens) - state.num_computed_tokens)])
    fill_step_kv(ctx)
    ctx.commit_step()


def poison(ctx):
    ctx.kv_cache.data.fill_(float("nan"))


def assert_zero(ctx, blocks):
    assert blocks, "the path acquired no page"
    planes = ctx.kv_cache.data[:, :, blocks]
    assert torch.equal(planes, torch.zeros_like(planes))


def snapshot(ctx, blocks):
    return ctx.kv_cache.data[:, :, blocks].clone()


def same_bytes(before, after):
    return torch.equal(before.view(torch.int32), after.view(torch.int32))


def test_admission_zeroes_fresh_pages_and_leaves_shared_cached_and_unrelated_pages_alone():
    ctx = make_context()
    ctx.add_request("a", list(range(10)))
    prefill(ctx, "a")
    ctx.add_request("other", [50, 51, 52])
    poison(ctx)
    a_blocks = ctx.request("a").block_ids
    unrelated = ctx.request("other").block_ids
    kept = snapshot(ctx, a_blocks + unrelated)
    ctx.add_request("b", list(range(8)) + [90, 91, 92])
    b = ctx.request("b")
    assert b.block_ids[:2] == a_blocks[:2]  # shared, cached
    assert_zero(ctx, b.block_ids[2:])
    assert same_bytes(kept, snapshot(ctx, a_blocks + unrelated))
    assert ctx.private_page_init_counts["admission"] == 3 + 1 + 1


@pytest.mark.parametrize("reason", [PageReason.DECODE_GROWTH, PageReason.LOOKAHEAD, PageReason.ASYNC_PREPARATION])
def test_growth_paths_zero_the_new_page(reason):
    ctx = make_context()
    ctx.add_request("a", list(range(8)))
    prefill(ctx, "a")
    ctx.append_tokens("a", [8])
    poison(ctx)
    old = ctx.request("a").block_ids[:]
    kept = snapshot(ctx, old)
    new = ctx.ensure_token_capacity("a", 9, reason)
    assert len(new) == 1
    assert_zero(ctx, new)
    assert same_bytes(kept, snapshot(ctx, old))
    assert ctx.private_page_init_counts[reason.value] == 1


def test_resume_after_pause_zeroes_the_page_it_acquires():
    ctx = make_context()
    ctx.add_request("a", list(range(4)))
    prefill(ctx, "a")
    ctx.append_tokens("a", [4])
    ctx.pause_request("a")
    poison(ctx)
    new = ctx.resume_request("a")
    assert_zero(ctx, new)
    assert ctx.private_page_init_counts["resume"] == 1
    ctx.build_step([("a", 1)])  # resumed and runnable


def test_handoff_import_leaves_pages_untouched_and_continuation_zeroes():
    ctx = make_context()
    poison(ctx)
    plan = ctx.import_request("x", list(range(8)), generated_tokens=[8])
    assert plan.first_block_index == 0 and len(plan.block_ids) == 2
    assert torch.isnan(ctx.kv_cache.data[:, :, plan.block_ids]).all()  # the transfer fills them
    assert ctx.private_page_init_counts["import"] == 0
    ctx.kv_cache.data[:, :, plan.block_ids] = 2.0  # the transfer lands
    ctx.commit_import("x")
    new = ctx.ensure_token_capacity("x", 9, PageReason.HANDOFF_CONTINUATION)
    assert_zero(ctx, new)
    assert ctx.private_page_init_counts["handoff_continuation"] == 1
    assert (ctx.kv_cache.data[:, :, plan.block_ids] == 2.0).all()
    # a second import of the same prompt pulls nothing: both blocks are cached now
    assert ctx.import_request("y", list(range(8))).block_ids == []


def test_lookahead_spare_page_poisoned_exactly_is_zero_after_allocation():
    ctx = make_context()
    ctx.add_request("a", list(range(4)))
    prefill(ctx, "a")
    (spare,) = ctx.pool.peek_free(1)
    ctx.kv_cache.data[:, :, spare] = float("nan")
    assert ctx.ensure_token_capacity("a", 4 + 3, PageReason.LOOKAHEAD) == [spare]
    v_plane = ctx.kv_cache.data[1, :, spare]
    assert torch.equal(v_plane, torch.zeros_like(v_plane))
    assert ctx.private_page_init_counts["lookahead"] == 1


def test_decode_after_growth_attends_without_nan():
    ctx = make_context()
    ctx.add_request("a", list(range(4)))
    prefill(ctx, "a")
    ctx.append_tokens("a", [4])
    poison(ctx)
    ctx.kv_cache.data[:, :, ctx.request("a").block_ids] = 1.0  # a's computed KV, finite
    ctx.ensure_token_capacity("a", 5, PageReason.DECODE_GROWTH)
    ctx.build_step([("a", 1)])
    out = ctx.store_kv_and_attend(1, torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 3))
    assert torch.isfinite(out).all()


def test_negative_control_skip_switch_leaves_poison_in_place():
    ctx = make_context()
    ctx._skip_private_page_init_for_tests = True
    poison(ctx)
    ctx.add_request("a", list(range(5)))
    assert torch.isnan(ctx.kv_cache.data[:, :, ctx.request("a").block_ids]).all()
    assert ctx.private_page_init_counts["admission"] == 2  # still counted: the path ran


def test_pages_handed_out_in_a_batched_block_are_zeroed_together_when_it_ends():
    """The scheduler grows every request of a step inside ``batched_page_init``: the fresh pages
    are zeroed in one call at its end (before any write), still each one exactly, the counts per
    path unchanged; nested blocks join the outer one."""
    ctx = make_context()
    for name, start in (("a", 0), ("b", 20)):
        ctx.add_request(name, list(range(start, start + 8)))
        prefill(ctx, name)
        ctx.append_tokens(name, [start + 8])
    poison(ctx)
    calls = []
    zero_blocks = ctx.kv_cache.zero_blocks
    ctx.kv_cache.zero_blocks = lambda ids: (calls.append(list(ids)), zero_blocks(ids))
    with ctx.batched_page_init():
        new_a = ctx.ensure_token_capacity("a", 9, PageReason.DECODE_GROWTH)
        with ctx.batched_page_init():
            new_b = ctx.ensure_token_capacity("b", 9, PageReason.DECODE_GROWTH)
        assert calls == [] and torch.isnan(ctx.kv_cache.data[:, :, new_a + new_b]).all()
    assert calls == [new_a + new_b]
    assert_zero(ctx, new_a + new_b)
    assert ctx.private_page_init_counts["decode_growth"] == 2
