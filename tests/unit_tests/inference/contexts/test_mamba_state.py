"""Mamba state slots: zeroed at admission, updated in place through the hook and written back
at commit, snapshotted at block ends and restored for a request that shares the prefix."""

import torch

from megatron.core.inference.contexts import Capacity, DynamicInferenceContext, StageCacheSpec
from megatron.core.inference.contexts.mamba_slots import MambaStateShapes

SHAPES = MambaStateShapes(conv=(3, 2), ssm=(2, 2, 2))


def make_context(prefix_caching=True):
    spec = StageCacheSpec((2,), (1,), num_kv_heads=1, head_dim=2, block_size=4, mamba_shapes=SHAPES)
    return DynamicInferenceContext(
        spec,
        Capacity(num_blocks=12, max_requests=3, num_mamba_slots=3, num_mamba_snapshots=3),
        max_sequence_length=32,
        max_tokens_per_step=32,
        is_hybrid_model=True,
        enable_prefix_caching=prefix_caching,
    )


def run_step(ctx, schedule, add):
    """One step where the 'mixer' adds ``add`` to each request's state, as an in-place update."""
    ctx.build_step(schedule)
    conv, ssm = ctx.mamba_states(1)
    conv += add
    ssm += add
    ctx.commit_step()


def test_fresh_slot_is_zero_and_hook_updates_reach_the_slot():
    ctx = make_context(prefix_caching=False)
    ctx.mamba_slots.conv.fill_(float("nan"))
    ctx.mamba_slots.ssm.fill_(float("nan"))
    ctx.add_request("a", [1, 2, 3])
    ctx.add_request("b", [4, 5])
    slot_a, slot_b = ctx.request("a").mamba_slot, ctx.request("b").mamba_slot
    assert torch.equal(ctx.mamba_slots.conv[:, slot_a], torch.zeros(1, *SHAPES.conv))
    ctx.build_step([("b", 2), ("a", 3)])
    assert not ctx.is_decode_only()
    conv, ssm = ctx.mamba_states(1)
    assert conv.shape == (2, 3, 2) and ssm.shape == (2, 2, 2, 2)
    conv[0] += 1.0  # request b
    ssm[1] += 2.0  # request a
    ctx.commit_step()
    assert (ctx.mamba_slots.conv[0, slot_b] == 1).all() and (ctx.mamba_slots.ssm[0, slot_a] == 2).all()
    assert (ctx.mamba_slots.conv[0, slot_a] == 0).all()


def test_snapshot_at_block_end_is_restored_for_a_sharing_request():
    ctx = make_context()
    prompt = list(range(10))
    ctx.add_request("a", prompt)
    run_step(ctx, [("a", 4)], add=1.0)  # step ends on block 0's end: snapshot (state 1)
    run_step(ctx, [("a", 6)], add=10.0)  # ends mid block: no snapshot
    assert len(ctx.mamba_snapshots) == 1
    cached = ctx.add_request("b", prompt[:8] + [77, 78])
    # block 1 is cached in the KV pool but has no Mamba snapshot: resume after block 0 only
    assert cached == 4
    b_slot = ctx.request("b").mamba_slot
    assert (ctx.mamba_slots.conv[:, b_slot] == 1).all() and (ctx.mamba_slots.ssm[:, b_slot] == 1).all()
    assert ctx.request("b").block_ids[0] == ctx.request("a").block_ids[0]


def test_attention_only_stage_of_hybrid_model_keeps_snapshot_keys_only():
    spec = StageCacheSpec((1,), (), num_kv_heads=1, head_dim=2, block_size=4)
    ctx = DynamicInferenceContext(
        spec,
        Capacity(num_blocks=12, max_requests=3, num_mamba_slots=3, num_mamba_snapshots=3),
        max_sequence_length=32,
        max_tokens_per_step=32,
        is_hybrid_model=True,
        enable_prefix_caching=True,
    )
    assert ctx.mamba_slots is None and ctx.mamba_snapshots.conv is None
    ctx.add_request("a", list(range(10)))
    ctx.build_step([("a", 4)])
    ctx.commit_step()
    ctx.build_step([("a", 6)])
    ctx.commit_step()
    # same decision as the Mamba stage above: only block 0 is resumable
    assert ctx.add_request("b", list(range(8)) + [77, 78]) == 4
