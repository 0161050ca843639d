"""Admission checks raise typed errors with their messages; prefilled imports skip only the
per-step token limit; errors round-trip through to_dict/from_dict and msgpack."""

import msgpack
import pytest

from megatron.core.inference.contexts import (
    Capacity,
    DynamicInferenceContext,
    InferenceRequestError,
    PromptExceedsStepTokenLimitError,
    PromptTooLongError,
    RequestExceedsPoolError,
    StageCacheSpec,
)


def make_context():
    spec = StageCacheSpec((1,), (), num_kv_heads=1, head_dim=2, block_size=4)
    return DynamicInferenceContext(
        spec, Capacity(num_blocks=5, max_requests=4), max_sequence_length=16, max_tokens_per_step=8
    )


def test_prompt_longer_than_max_sequence_length():
    with pytest.raises(PromptTooLongError) as err:
        make_context().add_request("a", list(range(17)))
    assert str(err.value) == (
        "prompt has 17 tokens but the maximum sequence length is 16; send a prompt of at most 16 tokens"
    )


def test_request_that_can_never_fit_the_pool():
    with pytest.raises(RequestExceedsPoolError) as err:
        make_context().add_request("a", list(range(8)), max_new_tokens=13)  # 21 tokens = 6 blocks > 5
    assert str(err.value) == (
        "request needs 21 tokens of KV cache (6 blocks of 4) but the pool holds only 5 blocks; it can never fit: "
        "ask for at most 20 tokens (prompt plus max new tokens)"
    )


def test_prompt_over_step_limit_without_chunked_prefill():
    ctx = make_context()
    with pytest.raises(PromptExceedsStepTokenLimitError) as err:
        ctx.add_request("a", list(range(12)))
    assert str(err.value) == (
        "prompt has 12 tokens but one step processes at most 8 tokens and chunked prefill is off; "
        "enable chunked prefill or send at most 8 prompt tokens"
    )
    assert ctx.num_requests == 0 and ctx.num_free_blocks == 5  # nothing half-applied
    ctx.enable_chunked_prefill = True
    ctx.add_request("a", list(range(12)))


def test_prefilled_import_skips_only_the_step_limit():
    ctx = make_context()
    ctx.check_admission(12, prefilled_import=True)
    plan = ctx.import_request("x", list(range(12)))
    assert len(plan.block_ids) == 3
    with pytest.raises(PromptTooLongError):
        ctx.check_admission(17, prefilled_import=True)
    with pytest.raises(RequestExceedsPoolError):
        ctx.check_admission(12, max_new_tokens=9, prefilled_import=True)
    with pytest.raises(PromptExceedsStepTokenLimitError):
        ctx.check_admission(12)


@pytest.mark.parametrize(
    "error",
    [
        PromptTooLongError(prompt_length=17, max_sequence_length=16),
        RequestExceedsPoolError(num_tokens=21, blocks_needed=6, pool_blocks=5, block_size=4),
        PromptExceedsStepTokenLimitError(prompt_length=12, max_tokens_per_step=8),
    ],
)
def test_errors_serialize_through_msgpack(error):
    wire = msgpack.packb(error.to_dict())
    rebuilt = InferenceRequestError.from_dict(msgpack.unpackb(wire))
    assert type(rebuilt) is type(error) and str(rebuilt) == str(error) and rebuilt == error
    assert isinstance(rebuilt, ValueError)


def test_unknown_error_type_is_rejected():
    with pytest.raises(ValueError, match="unknown inference request error type 'Nope'"):
        InferenceRequestError.from_dict({"type": "Nope", "message": "", "details": {}})
