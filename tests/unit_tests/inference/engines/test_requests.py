"""Admission errors, aborts in every state, seeded sampling, stop conditions and the
RequestOutput wire format."""

import re

import pytest

from megatron.core.inference.contexts.errors import (
    CapacityError,
    PromptExceedsStepTokenLimitError,
    PromptTooLongError,
)
from megatron.core.inference.engines import (
    DuplicateRequestIdError,
    DynamicInferenceEngine,
    EngineConfigError,
    InvalidPromptError,
    MaxSequenceLengthOverflowError,
    RequestOutput,
)
from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.kernels.mode import kernel_backend
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.dist_harness import device
from tests.unit_tests.inference.engines.common import gpt_model, hybrid_model, prompts, run
from tests.unit_tests.transformer.single_rank import on_single_rank

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _engine(model, pg, **kwargs):
    args = dict(block_size=4, num_blocks=8, max_tokens_per_step=8, max_sequence_length=24) | kwargs
    return DynamicInferenceEngine(model, pg_collection=pg, **args)


@on_single_rank
def test_each_admission_error_is_typed_serializable_and_the_engine_keeps_serving(pg):
    model = gpt_model(pg)
    engine = _engine(model, pg)
    engine.add_request("ok", prompts([5])[0], GREEDY)
    cases = [
        (prompts([25])[0], GREEDY, PromptTooLongError, "prompt has 25 tokens but the maximum sequence length is 24"),
        (
            prompts([20])[0],
            SamplingParams(max_tokens=10),
            MaxSequenceLengthOverflowError,
            "prompt of 20 tokens plus max_tokens=10 exceeds the maximum sequence length 24; ask for at most 4",
        ),
        (prompts([24])[0], GREEDY, MaxSequenceLengthOverflowError, "ask for at most 0 new tokens"),
        (
            prompts([12])[0],
            SamplingParams(max_tokens=12),
            PromptExceedsStepTokenLimitError,
            "prompt has 12 tokens but one step processes at most 8 tokens and chunked prefill is off",
        ),
        ([], GREEDY, InvalidPromptError, "invalid prompt: empty prompt"),
        ([0, 96], GREEDY, InvalidPromptError, "token id out of range; send a non-empty list of token ids in [0, 96)"),
        (prompts([5])[0], GREEDY, DuplicateRequestIdError, "request id 'ok' is already in use"),
    ]
    for index, (prompt, params, error_type, message) in enumerate(cases):
        request_id = "ok" if error_type is DuplicateRequestIdError else f"bad{index}"
        with pytest.raises(error_type, match=re.escape(message)) as err:
            engine.add_request(request_id, prompt, params)
        assert InferenceRequestError.from_dict(err.value.to_dict()) == err.value
    # The capacity plan sizes the pool for one request of max_sequence_length, so a request that
    # passes the length checks always fits: a pool smaller than that is refused up front.
    with pytest.raises(CapacityError, match="6 KV blocks, but one request of max_sequence_length 40 needs 10"):
        _engine(model, pg, num_blocks=6, max_sequence_length=40)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["ok"]
    assert sum(len(o.new_token_ids) for o in outputs) == 6


@on_single_rank
def test_prefilled_import_skips_only_the_step_token_limit(pg):
    model = gpt_model(pg)
    engine = _engine(model, pg, num_blocks=6)
    prompt = prompts([12])[0]
    with pytest.raises(PromptExceedsStepTokenLimitError):
        engine.add_request("plain", prompt, GREEDY)
    engine.add_request("imported", prompt, GREEDY, prefilled_import=True)
    with pytest.raises(PromptTooLongError):
        engine.add_request("long", prompts([25])[0], GREEDY, prefilled_import=True)
    with pytest.raises(MaxSequenceLengthOverflowError):
        engine.add_request("huge", prompt, SamplingParams(max_tokens=13), prefilled_import=True)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    roomy = run(_engine(model, pg, max_tokens_per_step=16), [prompt], GREEDY)
    assert results["imported"] == roomy["0"]["tokens"]


@on_single_rank
def test_abort_in_waiting_active_and_paused_states_gives_one_terminal_output(pg):
    model = gpt_model(pg)
    engine = _engine(model, pg, num_blocks=6, max_requests=2, paused_block_budget=6)
    params = SamplingParams(temperature=0.0, max_tokens=15)
    for index, prompt in enumerate(prompts([6, 6, 4])):
        engine.add_request(str(index), prompt, params)
    outputs = engine.step()  # admits 0 and 1 (request cap 2); 2 waits
    states = {}
    while not engine.scheduler.paused:
        outputs += engine.step()
    paused = engine.scheduler.paused[0].request_id
    active = next(r.request_id for r in engine.scheduler.admitted if r.request_id != paused)
    states = {"2": "waiting", paused: "paused", active: "active"}
    assert engine.scheduler.waiting[0].request_id == "2"
    for request_id in states:
        engine.abort(request_id)
        engine.abort(request_id)  # a second abort is ignored
    outputs += engine.step()
    terminal = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in terminal) == ["0", "1", "2"]
    assert all(o.finish_reason == "abort" for o in terminal)
    assert not engine.has_unfinished_requests() and engine.context.num_free_blocks == 6
    assert engine.step() == []


def _sampled(model, pg, batch_prompts, params):
    return run(_engine(model, pg, num_blocks=64, max_tokens_per_step=32, max_sequence_length=64), batch_prompts, params)


@on_single_rank
def test_seeded_sampling_does_not_depend_on_the_batch(pg):
    model = gpt_model(pg)
    target = prompts([7], seed=3)[0]
    seeded = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=1234, max_tokens=10)
    alone = _sampled(model, pg, [target], [seeded])["0"]["tokens"]
    others = prompts([4, 9, 5], seed=4)
    crowd = _sampled(
        model,
        pg,
        others + [target],
        [SamplingParams(temperature=1.0, seed=s, max_tokens=14) for s in range(3)] + [seeded],
    )["3"]["tokens"]
    reseeded = _sampled(
        model, pg, [target], [SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=99, max_tokens=10)]
    )["0"]["tokens"]
    assert alone == crowd and len(alone) == 10
    assert reseeded != alone


@on_single_rank
def test_stop_token_ends_with_stop_and_request_output_round_trips(pg):
    model = gpt_model(pg)
    greedy = _sampled(model, pg, prompts([5]), [GREEDY])["0"]["tokens"]
    engine = _engine(model, pg, eos_token_id=greedy[2])
    result = run(engine, prompts([5]), [SamplingParams(temperature=0.0, max_tokens=6, logprobs=True)])["0"]
    assert result["tokens"] == greedy[:3] and result["finish_reason"] == "stop" and len(result["log_probs"]) == 3
    ignoring = run(
        _engine(model, pg, eos_token_id=greedy[2]),
        prompts([5]),
        [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)],
    )["0"]
    assert ignoring["tokens"] == greedy[:6] and ignoring["finish_reason"] == "length"
    output = RequestOutput("r", [1, 2], [-0.5, -1.0], "hi", True, "stop", None, [-2.0], 5, 2)
    assert RequestOutput.from_dict(output.to_dict()) == output


@on_single_rank
def test_a_prompt_of_a_whole_step_runs_while_others_decode(pg):
    # Without chunked prefill a prompt of max_tokens_per_step tokens never fits beside a decode
    # token: deferred once, it goes first in the next step (the decode waits that step), not after
    # every decoding request ended. Steps run one by one (no overlap, which reports a step's tokens
    # at the next step), so a token's step is the step that computed it.
    model = gpt_model(pg)
    requests = {"short": (prompts([3])[0], SamplingParams(temperature=0.0, max_tokens=12))}
    requests["whole"] = (prompts([8])[0], GREEDY)
    engine = _engine(model, pg, num_blocks=16, overlap_steps=False)
    outputs, token_steps = {}, {}
    for step in range(40):
        if step < 2:
            engine.add_request(list(requests)[step], *requests[list(requests)[step]])
        for out in engine.step():
            token_steps.setdefault(out.request_id, []).append(step)
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert token_steps["whole"][0] == 2
    assert token_steps["short"][:3] == [0, 1, 3]  # it waited only the step the whole prompt ran
    for request_id, (prompt, params) in requests.items():  # the same tokens as alone
        assert outputs[request_id] == run(_engine(model, pg, num_blocks=16), [prompt], params)["0"]["tokens"]


@on_single_rank
def test_long_prefill_token_threshold_spreads_a_step_over_prompts_and_keeps_their_tokens(pg):
    """With chunked prefill and a threshold of 4, prompts of 9 and 7 tokens prefill side by side
    in chunks of at most 4 (5 rather than leave a one-token final chunk) and give the greedy tokens
    they give without it; 1 is refused with its one-line error."""
    model = gpt_model(pg)
    requests = prompts([9, 7])
    chunks = []

    def capped(**kwargs):
        engine = _engine(model, pg, enable_chunked_prefill=True, **kwargs)
        build_step = engine.context.build_step

        def recording(schedule, **step_kwargs):
            chunks.append([n for _, n in schedule])
            return build_step(schedule, **step_kwargs)

        engine.context.build_step = recording
        return engine

    want = run(capped(long_prefill_token_threshold=0), requests, GREEDY)
    assert chunks[0] == [7, 1]  # off: the first prompt fills the step (7, leaving it 2, not 1)
    chunks.clear()
    got = run(capped(long_prefill_token_threshold=4), requests, GREEDY)
    # 9 = 4 + 5, not 4 + 4 + 1; then both decode
    assert chunks[:3] == [[4, 4], [5, 3], [1, 1]]
    assert {request_id: r["tokens"] for request_id, r in got.items()} == {
        request_id: r["tokens"] for request_id, r in want.items()
    }
    message = "long_prefill_token_threshold must be 0 (off) or >= 2, got 1"
    with pytest.raises(EngineConfigError, match=re.escape(message)):
        _engine(model, pg, long_prefill_token_threshold=1)


@on_single_rank
def test_the_automatic_long_prefill_threshold_is_on_only_for_token_by_token_hybrid_prefill(pg):
    """Off for a GPT model and for a hybrid model's unpadded mode; an eighth of the step's budget
    (at least 16) for a hybrid model's batch-invariant prefill on the torch Mamba path (the CPU's;
    the GPU's chunked Triton scan prefills a prompt at once, so there it is off too)."""
    token_by_token = kernel_backend(device()) != "triton"
    thresholds = [
        _engine(
            model, pg, batch_invariant=invariant, max_requests=2, max_tokens_per_step=256
        ).scheduler.long_prefill_token_threshold
        for model, invariant in ((gpt_model(pg), True), (hybrid_model(pg), True), (hybrid_model(pg), False))
    ]
    assert thresholds == [0, 32 if token_by_token else 0, 0]
