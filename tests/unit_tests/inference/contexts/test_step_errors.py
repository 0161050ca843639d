"""Misuse of the step API gets typed errors naming what was wrong."""

import pytest
import torch

from megatron.core.inference.contexts import (
    Capacity,
    DynamicInferenceContext,
    LayerNotOnStageError,
    StageCacheSpec,
    StepError,
    UnknownRequestError,
)


def make_context():
    spec = StageCacheSpec((2, 5), (), num_kv_heads=1, head_dim=2, block_size=4)
    return DynamicInferenceContext(
        spec, Capacity(num_blocks=6, max_requests=2), max_sequence_length=16, max_tokens_per_step=8
    )


def test_hook_on_a_layer_of_another_stage():
    ctx = make_context()
    ctx.add_request("a", [1, 2])
    ctx.build_step([("a", 2)])
    x = torch.zeros(2, 1, 1, 2)
    with pytest.raises(
        LayerNotOnStageError, match=r"layer 3 is not a attention layer of this stage; its attention layers are \[2, 5\]"
    ):
        ctx.store_kv_and_attend(3, x, x, x)


def test_step_needs_blocks_uncomputed_tokens_and_a_commit():
    ctx = make_context()
    with pytest.raises(StepError, match="no step is being run"):
        ctx.store_kv_and_attend(2, *(torch.zeros(1, 1, 1, 2),) * 3)
    ctx.add_request("a", [1, 2, 3, 4])
    with pytest.raises(StepError, match="asks for 5 new tokens but has 4 uncomputed"):
        ctx.build_step([("a", 5)])
    ctx.build_step([("a", 4)])
    with pytest.raises(StepError, match="previous step was not committed"):
        ctx.build_step([("a", 1)])
    ctx.commit_step()
    ctx.append_tokens("a", [5])
    with pytest.raises(StepError, match=r"has blocks for 4 tokens, needs 5 \(call ensure_token_capacity first\)"):
        ctx.build_step([("a", 1)])
    with pytest.raises(UnknownRequestError, match="request 'zz' is not in the context"):
        ctx.build_step([("zz", 1)])


def test_request_row_padding_must_fit_the_step():
    ctx = make_context()
    ctx.add_request("a", [1, 2, 3])
    with pytest.raises(StepError, match=r"padding_request_tokens must be 0 or 1, got 2"):
        ctx.build_step([("a", 3)], pad_to_tokens=8, pad_to_requests=2, padding_request_tokens=2)
    with pytest.raises(StepError, match=r"padding requests of one token pad a decode-only step"):
        ctx.build_step([("a", 3)], pad_to_tokens=8, pad_to_requests=2)
    with pytest.raises(
        StepError,
        match=r"pad_to_requests=1 pads 1 requests of 3 tokens with padding requests of 0 token\(s\), which must "
        r"fit pad_to_tokens=2",
    ):
        ctx.build_step([("a", 3)], pad_to_tokens=2, pad_to_requests=1, padding_request_tokens=0)
    with pytest.raises(StepError, match=r"pad_to_requests=9 exceeds 8 step rows"):
        ctx.build_step([("a", 3)], pad_to_tokens=8, pad_to_requests=9, padding_request_tokens=0)
    batch = ctx.build_step([("a", 3)], pad_to_tokens=8, pad_to_requests=4, padding_request_tokens=0)
    assert batch.query_lengths.tolist() == [3, 0, 0, 0] and batch.cu_query_lengths.tolist() == [0, 3, 3, 3, 3]
    assert batch.num_tokens == 3 and batch.num_padded_tokens == 8 and not batch.decode_only
