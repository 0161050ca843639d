"""Capacity sizing from a budget (hand-computed), and the PP negotiation on 2 gloo ranks: a
stage with Mamba layers and one without agree, in bounded time, and a remote limiting stage
is named on the stage that fits."""

import pytest

from megatron.core.inference.contexts import (
    CapacityConfig,
    CapacityError,
    DynamicInferenceContext,
    InferenceContextError,
    StageCacheSpec,
    plan_stage_capacity,
)
from megatron.core.inference.contexts.capacity import NEUTRAL
from megatron.core.inference.contexts.mamba_slots import MambaStateShapes
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import run_distributed

SHAPES = MambaStateShapes(conv=(8, 3), ssm=(2, 4, 4))  # (24 + 32) * 4 = 224 bytes per layer
ATTENTION_STAGE = StageCacheSpec((1, 2), (), num_kv_heads=2, head_dim=4, block_size=4)  # 512 B per block
MAMBA_STAGE = StageCacheSpec((), (3, 4), num_kv_heads=2, head_dim=4, block_size=4, mamba_shapes=SHAPES)
HYBRID_STAGE = StageCacheSpec((2,), (1,), num_kv_heads=2, head_dim=4, block_size=4, mamba_shapes=SHAPES)


def test_stage_sizes_from_budget_by_hand():
    assert ATTENTION_STAGE.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4
    assert MAMBA_STAGE.bytes_per_mamba_slot == 2 * 224
    local = plan_stage_capacity(
        ATTENTION_STAGE, CapacityConfig(buffer_size_bytes=512 * 20), max_sequence_length=16, enable_prefix_caching=False
    )
    assert (local.num_blocks, local.num_mamba_slots, local.max_requests) == (19, NEUTRAL, NEUTRAL)  # dummy inside
    # hybrid stage, ratio 0.25 of 8192: 2048 B of Mamba -> 2048 // 224 slots; rest -> (6144 // 256) - 1 blocks
    local = plan_stage_capacity(
        HYBRID_STAGE,
        CapacityConfig(buffer_size_bytes=8192, mamba_memory_ratio=0.25),
        max_sequence_length=16,
        enable_prefix_caching=False,
    )
    assert (local.num_blocks, local.num_mamba_slots, local.max_requests) == (23, 9, 9)
    # prefix caching reserves a snapshot entry and a scratch row per request inside the budget
    local = plan_stage_capacity(
        HYBRID_STAGE,
        CapacityConfig(buffer_size_bytes=8192, mamba_memory_ratio=0.25),
        max_sequence_length=16,
        enable_prefix_caching=True,
    )
    assert local.num_mamba_slots == 2048 // (3 * 224)
    local = plan_stage_capacity(
        HYBRID_STAGE, CapacityConfig(num_blocks=7, max_requests=3), max_sequence_length=16, enable_prefix_caching=False
    )
    assert (local.num_blocks, local.num_mamba_slots, local.max_requests) == (7, 3, 3)


def test_capacity_config_errors_name_fields():
    with pytest.raises(InferenceContextError, match="mamba_memory_ratio must be in \\(0, 1\\), got 1.5"):
        CapacityConfig(buffer_size_bytes=10, mamba_memory_ratio=1.5)
    with pytest.raises(InferenceContextError, match="not both"):
        CapacityConfig(buffer_size_bytes=10, mamba_memory_ratio=0.5, mamba_budget_bytes=3)
    with pytest.raises(InferenceContextError, match="needs buffer_size_bytes or num_blocks"):
        plan_stage_capacity(
            ATTENTION_STAGE, CapacityConfig(max_requests=2), max_sequence_length=8, enable_prefix_caching=False
        )


def _create_on_stage(mamba_budget_bytes):
    pg = ProcessGroupCollection.from_layout(RankLayout(pp=2))
    spec = ATTENTION_STAGE if pg.rank("pp") == 0 else MAMBA_STAGE
    config = CapacityConfig(buffer_size_bytes=512 * 20, mamba_budget_bytes=mamba_budget_bytes)
    try:
        ctx = DynamicInferenceContext.create(
            spec,
            config,
            max_sequence_length=16,
            max_tokens_per_step=16,
            is_hybrid_model=True,
            enable_prefix_caching=True,
            pg_collection=pg,
            negotiation_timeout_s=20,
        )
    except CapacityError as err:
        return {"error": str(err), "limiting_stage": err.limiting_stage}
    return {
        "capacity": ctx.capacity,
        "mamba_buffers": ctx.mamba_slots is not None,
        "snapshot_tensors": ctx.mamba_snapshots.conv is not None,
        "kv_layers": ctx.kv_cache.num_layers,
    }


def test_pipeline_stages_with_and_without_mamba_agree_in_bounded_time():
    attention_stage, mamba_stage = run_distributed(_create_on_stage, 2, 3 * 448 * 5, timeout_s=60)
    assert attention_stage["capacity"] == mamba_stage["capacity"]
    capacity = attention_stage["capacity"]
    assert (capacity.num_blocks, capacity.max_requests, capacity.num_mamba_slots) == (19, 5, 5)
    assert capacity.num_mamba_snapshots == 5
    assert not attention_stage["mamba_buffers"] and not attention_stage["snapshot_tensors"]
    assert mamba_stage["mamba_buffers"] and mamba_stage["snapshot_tensors"]
    assert (attention_stage["kv_layers"], mamba_stage["kv_layers"]) == (2, 0)


def test_remote_limiting_stage_is_named_on_the_fitting_stage():
    attention_stage, mamba_stage = run_distributed(_create_on_stage, 2, 1000, timeout_s=60)
    assert attention_stage["limiting_stage"] == mamba_stage["limiting_stage"] == 1
    assert (
        "pipeline stage 1 (a remote stage; this is stage 0) cannot fit the state of one request"
        in (attention_stage["error"])
    )
    assert mamba_stage["error"].startswith(
        "pipeline stage 1 (this stage) cannot fit the state of one request: 1000 bytes of Mamba budget, "
        "but one request's Mamba state needs 1344 bytes"
    )


def _stage_one_joins_after_the_timeout():
    import time

    import torch.distributed as dist

    from megatron.core.inference.contexts import CapacityNegotiationTimeoutError

    def create(timeout_s):
        return DynamicInferenceContext.create(
            ATTENTION_STAGE,
            CapacityConfig(buffer_size_bytes=512 * 20),
            max_sequence_length=16,
            max_tokens_per_step=16,
            is_hybrid_model=False,
            pg_collection=pg,
            negotiation_timeout_s=timeout_s,
        )

    pg = ProcessGroupCollection.from_layout(RankLayout(pp=2))
    if pg.rank("pp") == 1:
        time.sleep(3)  # creates its context only after stage 0 gave up
        # Joining late leaves no rank with a collective pending (a later collective of this
        # world would pair with it): on gloo it completes stage 0's abandoned all-reduce; on
        # NCCL stage 0's timed-out wait aborted the communicator, so this one times out too.
        try:
            return dist.get_backend(), create(timeout_s=10).capacity
        except CapacityNegotiationTimeoutError:
            return dist.get_backend(), None
    start = time.monotonic()
    with pytest.raises(CapacityNegotiationTimeoutError, match="not every pipeline stage joined"):
        create(timeout_s=1)
    return time.monotonic() - start


def test_negotiation_that_a_stage_never_joins_fails_within_its_timeout():
    elapsed, (backend, late_capacity) = run_distributed(_stage_one_joins_after_the_timeout, 2, timeout_s=30)
    assert elapsed < 2.5
    assert late_capacity is not None or backend == "nccl"  # gloo completed the abandoned all-reduce
