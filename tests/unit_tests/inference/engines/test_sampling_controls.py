"""Sampling controls (logit bias, min_tokens, presence / frequency / repetition penalties, min_p):
each formula against a hand computation element by element, the engine's greedy tokens against a
cache-free decoder that applies the formulas by hand to the model's logits, and batch invariance:
a tight pool (pauses, evictions), overlapped steps, static-buffer steps and speculative decoding
give exactly the tokens of a roomy plain run."""

import math

import pytest
import torch

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.engines.errors import LogitBiasTokenOutOfRangeError, StopTokenIdsOutOfRangeError
from megatron.core.inference.sampling import InvalidSamplingParamsError, SamplingParams, filtered_probs
from megatron.core.inference.sampling_controls import ControlRow, TokenCounts, apply_sampling_controls
from tests.unit_tests.dist_harness import device
from tests.unit_tests.inference.engines.common import (
    VOCAB,
    assert_same_outputs,
    gpt_model,
    mtp_model_with_tied_heads,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

PENALIZED = SamplingParams(
    temperature=0.0,
    max_tokens=20,
    logprobs=True,
    presence_penalty=0.7,
    frequency_penalty=0.4,
    repetition_penalty=1.6,
    logit_bias=((3, 2.5), (11, -1.0)),
)


def hand_controls(logits: list[float], params: SamplingParams, prompt, generated, eos=None) -> list[float]:
    """The module doc's formulas, one element at a time in plain Python (float32 rounding aside)."""
    out = list(logits)
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(generated) < params.min_tokens:
        for token in params.stop_token_ids:
            out[token] = -math.inf
        if eos is not None and not params.ignore_eos:
            out[eos] = -math.inf
    for token in range(len(out)):
        count = generated.count(token)
        if token in prompt or count:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def test_controls_match_the_hand_formulas_per_row_with_drafts_and_slot_reuse():
    torch.manual_seed(0)
    vocab = 12
    counts = TokenCounts(num_slots=2, vocab_size=vocab, device="cpu")
    params = [
        PENALIZED,
        SamplingParams(min_tokens=3, logit_bias={5: 100.0}, stop_token_ids=[4, 6]),
        SamplingParams(),  # untouched
        SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5),
    ]
    histories = [([1, 2, 3], [4, 4, 9]), ([0], [7]), ([2], [2]), ([6, 6], [])]
    for step in range(3):  # the same requests again: only the new tokens are counted
        rows = [
            ControlRow(str(i), p, prompt, generated, drafts=[8] if i == 0 and step == 2 else [])
            for i, (p, (prompt, generated)) in enumerate(zip(params, histories, strict=True))
        ]
        logits = torch.randn(4, vocab) * 3
        want = [
            hand_controls(logits[i].tolist(), row.params, row.prompt, list(row.generated) + list(row.drafts), eos=0)
            for i, row in enumerate(rows)
        ]
        apply_sampling_controls(logits, rows, counts, eos_token_id=0)
        torch.testing.assert_close(logits, torch.tensor(want), rtol=1e-6, atol=1e-6)
        for _, generated in histories:
            generated.append(step + 1)
    # Two slots, three penalized requests in turn: the finished one's slot is reused from zero.
    counts.release("0")
    fresh = ControlRow("4", SamplingParams(frequency_penalty=1.0), [11], [10, 10])
    logits = torch.zeros(1, vocab)
    apply_sampling_controls(logits, [fresh], counts, eos_token_id=None)
    assert logits[0].tolist() == hand_controls([0.0] * vocab, fresh.params, [11], [10, 10])


def test_min_tokens_masks_eos_until_reached_and_not_with_ignore_eos():
    counts = TokenCounts(1, 4, "cpu")
    logits = torch.zeros(3, 4)
    rows = [
        ControlRow("a", SamplingParams(min_tokens=2), [1], [1]),  # 1 generated < 2: masked
        ControlRow("b", SamplingParams(min_tokens=2), [1], [1, 1]),  # reached: free
        ControlRow("c", SamplingParams(min_tokens=2, ignore_eos=True), [1], []),
    ]
    apply_sampling_controls(logits, rows, counts, eos_token_id=3)
    assert logits[:, 3].tolist() == [-math.inf, 0.0, 0.0]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    temperature = 0.5
    probs = torch.softmax(logits / temperature, dim=-1)[0]
    min_p = 0.1
    keep = probs >= min_p * probs.max()
    want = torch.where(keep, probs, 0) / probs[keep].sum()
    got = filtered_probs(
        logits, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([min_p])
    )
    torch.testing.assert_close(got[0], want)
    assert keep.tolist() == [True, True, False, False, False]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2] (0 disables), got 2.5"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be a number in [-2, 2] (0 disables), got nan"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0 (1 disables), got 0.0"),
        ("min_p", 1.5, "min_p must be a number in [0, 1] (0 disables), got 1.5"),
        ("min_tokens", -1, "min_tokens must be an integer >= 0, got -1"),
        ("min_tokens", True, "min_tokens must be an integer >= 0, got True"),
        ("logit_bias", {3: 101}, "logit_bias values must be numbers in [-100, 100], got 101 for token 3"),
        ("logit_bias", {-1: 1.0}, "logit_bias keys must be token ids (integers >= 0), got -1"),
        ("logit_bias", "x", "logit_bias must map token ids to biases, got 'x'"),
        ("stop_token_ids", [1, -2], "stop_token_ids must be a list of token ids (integers >= 0), got [1, -2]"),
    ],
)
def test_invalid_controls_raise_typed_errors_naming_the_field(field, value, message):
    with pytest.raises(InvalidSamplingParamsError) as error:
        SamplingParams(**{field: value})
    assert str(error.value) == message
    with pytest.raises(InvalidSamplingParamsError, match=r"^min_tokens=5 must be at most max_tokens=4$"):
        SamplingParams(min_tokens=5, max_tokens=4)


@torch.no_grad()
def reference_controlled_greedy(model, prompt, params: SamplingParams, eos=None) -> list[int]:
    """Greedy decoding by full forward passes (no cache), the controls applied by hand."""
    tokens, vocab = list(prompt), model.vocab_size
    for _ in range(params.max_tokens):
        logits = model(torch.tensor([tokens], device=device()))[0, -1, :vocab].float().cpu().tolist()
        controlled = hand_controls(logits, params, prompt, tokens[len(prompt) :], eos)
        tokens.append(max(range(vocab), key=lambda t: (controlled[t], -t)))
        if tokens[-1] == eos or tokens[-1] in params.stop_token_ids:
            break
    return tokens[len(prompt) :]


ARGS = dict(block_size=4, max_requests=8, max_tokens_per_step=32, max_sequence_length=64)


@on_single_rank
def test_engine_greedy_tokens_follow_the_hand_formulas_on_the_models_logits(pg):
    model = gpt_model(pg)
    requests = prompts([5, 9, 3])
    params = [PENALIZED, SamplingParams(temperature=0.0, max_tokens=20), PENALIZED]
    results = run(DynamicInferenceEngine(model, num_blocks=64, pg_collection=pg, **ARGS), requests, params)
    for index, (prompt, p) in enumerate(zip(requests, params, strict=True)):
        assert results[str(index)]["tokens"] == reference_controlled_greedy(model, prompt, p), index
    plain = run(
        DynamicInferenceEngine(model, num_blocks=64, pg_collection=pg, **ARGS),
        requests,
        SamplingParams(temperature=0.0, max_tokens=20),
    )
    assert results["0"]["tokens"] != plain["0"]["tokens"]  # the penalties changed something
    assert results["1"] == plain["1"]  # the request without controls is untouched
    # Log-probs are the model's, before the controls (vLLM's default): a plain request's are equal.
    assert results["1"]["log_probs"] == plain["1"]["log_probs"]


@on_single_rank
def test_min_tokens_holds_back_eos_in_the_engine(pg):
    model = gpt_model(pg)
    (prompt,) = prompts([6])
    plain = run(
        DynamicInferenceEngine(model, num_blocks=64, pg_collection=pg, **ARGS),
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=12),
    )
    eos = plain["0"]["tokens"][1]
    engine = DynamicInferenceEngine(model, num_blocks=64, eos_token_id=eos, pg_collection=pg, **ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6)
    (result,) = run(engine, [prompt], params).values()
    assert result["tokens"] == reference_controlled_greedy(model, prompt, params, eos)
    assert len(result["tokens"]) >= 6 and eos not in result["tokens"][:6]
    with pytest.raises(LogitBiasTokenOutOfRangeError, match=r"logit_bias holds token ids \[96\] outside"):
        engine.add_request("bad", prompt, SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(StopTokenIdsOutOfRangeError, match=r"stop_token_ids holds token ids \[97\] outside"):
        engine.add_request("bad", prompt, SamplingParams(stop_token_ids=[3, 97]))
    # stop_token_ids end a request like EOS (ignore_eos does not change that), masked before min_tokens.
    stop_token = plain["0"]["tokens"][2]
    for params, length in (
        (SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token], ignore_eos=True), 3),
        (SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token], min_tokens=4), None),
    ):
        engine = DynamicInferenceEngine(model, num_blocks=64, pg_collection=pg, **ARGS)
        (result,) = run(engine, [prompt], params).values()
        assert result["tokens"] == reference_controlled_greedy(model, prompt, params)
        assert result["finish_reason"] == "stop" or len(result["tokens"]) == 12
        if length is not None:
            assert len(result["tokens"]) == length and result["finish_reason"] == "stop"
        else:
            assert stop_token not in result["tokens"][:4] and len(result["tokens"]) >= 4


@on_single_rank
def test_controls_are_batch_invariant_under_pauses_evictions_overlap_graphs_and_speculation(pg):
    model = mtp_model_with_tied_heads(pg)
    lengths = [3, 11, 6, 14, 9, 4]
    new_tokens = 24
    seeded = SamplingParams(
        temperature=0.9, seed=5, min_p=0.05, top_k=30, max_tokens=new_tokens, frequency_penalty=0.5, min_tokens=4
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, presence_penalty=1.0, repetition_penalty=1.3)
    params = [seeded, greedy, SamplingParams(temperature=0.0, max_tokens=new_tokens), greedy, seeded, greedy]
    requests = prompts(lengths)
    args = dict(ARGS, max_sequence_length=40)
    roomy = run(
        DynamicInferenceEngine(model, num_blocks=100, paused_block_budget=100, pg_collection=pg, **args),
        requests,
        params,
    )
    for modes in (
        dict(overlap_steps=True),
        dict(overlap_steps=True, enable_cuda_graphs=True),
        dict(num_speculative_tokens=2),
    ):
        engine = DynamicInferenceEngine(model, num_blocks=12, paused_block_budget=3, pg_collection=pg, **args, **modes)
        tight = run(engine, requests, params)
        assert engine.stats["evictions"] > 0 or engine.stats["pauses"] > 0, modes
        if "num_speculative_tokens" in modes:
            assert engine.stats["drafts_accepted"] > 0
        assert_same_outputs(tight, roomy)
        assert not engine.token_counts._slots  # every finished request gave its row back


@on_single_rank
def test_stop_sequences_end_nothing_before_min_tokens(pg):
    from megatron.core.tokenizers.byte_level import ByteLevelTokenizer

    model = gpt_model(pg)
    (prompt,) = prompts([5])
    args = dict(ARGS, tokenizer=ByteLevelTokenizer())
    plain = run(
        DynamicInferenceEngine(model, num_blocks=64, pg_collection=pg, **args),
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=10),
    )
    text = plain["0"]["text"]
    stop = text[1]
    stopped = run(
        DynamicInferenceEngine(model, num_blocks=64, pg_collection=pg, **args),
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=10, stop=stop),
    )["0"]
    held = run(
        DynamicInferenceEngine(model, num_blocks=64, pg_collection=pg, **args),
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=10, stop=stop, min_tokens=4),
    )["0"]
    assert stopped["text"] == text[: text.index(stop)] and len(stopped["tokens"]) == 2
    # Before 4 tokens the stop is plain text; a later occurrence (or the length) ends it.
    later = text.find(stop, 3)
    assert held["text"] == (text if later < 0 else text[:later])
    assert held["tokens"] == plain["0"]["tokens"][: len(held["tokens"])] and len(held["tokens"]) >= 4


def test_sampling_controls_survive_the_wire_format():
    import msgpack

    from megatron.core.inference.coordinator.messages import sampling_params_from_dict, sampling_params_to_dict

    params = SamplingParams(logit_bias={5: 1.5, 2: -3}, min_tokens=2, presence_penalty=0.5, min_p=0.1)
    wire = msgpack.unpackb(msgpack.packb(sampling_params_to_dict(params)))
    assert sampling_params_from_dict(wire) == params and params.logit_bias == ((2, -3.0), (5, 1.5))
