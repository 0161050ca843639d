"""Sampling: greedy is argmax, top-k/top-p masks on hand-made distributions, seeded rows are
reproducible whatever their batch neighbours, frequencies match the softmax, the counter-based
draws equal a pure-Python hash, bad params fail."""

import math

import pytest
import torch

from megatron.core.inference.sampling import (
    CounterGenerator,
    InvalidSamplingParamsError,
    SamplingInputError,
    SamplingParams,
    SamplingRows,
    counter_uniforms,
    filtered_probs,
    make_generator,
    prompt_logprobs,
    sample,
    token_logprobs,
    top_logprobs,
)
from megatron.core.inference.stop_words import InvalidStopSequencesError

# A hand-made distribution, deliberately not sorted by token id.
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.2, 0.1])
LOGITS = PROBS.log()


def filtered(temperature=1.0, top_k=0, top_p=1.0, logits=LOGITS):
    return filtered_probs(logits[None], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))[0]


def rows(params, generators, draws):
    return SamplingRows.build(params, generators, draws, "cpu")


def test_greedy_is_argmax_and_draws_nothing():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    greedy = rows([SamplingParams(temperature=0, top_k=2, seed=3)] * 6, [None] * 6, range(6))
    assert greedy.drawing_rows is None
    assert torch.equal(sample(logits, greedy), logits.argmax(dim=-1))


def test_top_k_keeps_the_k_most_likely_renormalized():
    expected = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.0]) / 0.7
    torch.testing.assert_close(filtered(top_k=2), expected)


def test_top_k_keeps_ties_with_the_kth_token():
    torch.testing.assert_close(filtered(top_k=1, logits=torch.tensor([1.0, 3.0, 3.0])), torch.tensor([0.0, 0.5, 0.5]))


@pytest.mark.parametrize(
    "top_p,kept",
    [(0.1, [1]), (0.6, [1, 3]), (0.75, [1, 3, 0]), (0.9, [1, 3, 0, 4]), (1.0, [0, 1, 2, 3, 4])],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    expected = torch.zeros(5)
    expected[kept] = PROBS[kept] / PROBS[kept].sum()
    torch.testing.assert_close(filtered(top_p=top_p), expected)


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    # After top-k=2 the distribution is (5/7, 2/7); 5/7 alone already exceeds 0.6.
    torch.testing.assert_close(filtered(top_k=2, top_p=0.6), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))


def test_temperature_scales_logits():
    expected = PROBS ** (1 / 0.5)
    torch.testing.assert_close(filtered(temperature=0.5), expected / expected.sum())


def test_tiny_temperature_is_finite():
    torch.testing.assert_close(filtered(temperature=1e-30), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))


def draw_steps(logits_per_step, params, generator):
    return [int(sample(step[None], rows([params], [generator], [i]))[0]) for i, step in enumerate(logits_per_step)]


def test_seeded_rows_are_reproducible_and_independent_of_batch_neighbours():
    steps = torch.randn(12, 4, 50, generator=torch.Generator().manual_seed(1))  # [step, row, V]
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    alone = draw_steps(steps[:, 0], target, make_generator(target.seed))
    assert alone == draw_steps(steps[:, 0], target, make_generator(target.seed))
    neighbours = [SamplingParams(temperature=0), SamplingParams(seed=7), SamplingParams(top_p=0.5, seed=9)]
    for position in range(4):
        params = neighbours[:position] + [target] + neighbours[position:]
        generators = [make_generator(p.seed) if not p.greedy else None for p in params]
        columns = (
            [steps[:, 1 + i] for i in range(position)] + [steps[:, 0]] + [steps[:, 1 + i] for i in range(position, 3)]
        )
        batch = torch.stack(columns, dim=1)
        in_batch = []
        for step_index in range(len(steps)):
            draws = [step_index + 5 * (j + 1) for j in range(4)]  # neighbours generated other amounts so far
            draws[position] = step_index
            in_batch.append(int(sample(batch[step_index], rows(params, generators, draws))[position]))
        assert in_batch == alone


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(40, 1000)
    tokens = {
        tuple(sample(logits, rows([SamplingParams(seed=s)] * 40, [make_generator(s)] * 40, range(40))).tolist())
        for s in (1, 2)
    }
    assert len(tokens) == 2


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_counter_draws_are_the_documented_hash_and_the_state_is_the_seed():
    generator = CounterGenerator(2**64 - 5)
    draws = [0, 1, 7, 2**31 + 3]
    keys = torch.tensor([generator.keys] * len(draws))
    got = counter_uniforms(keys, torch.tensor(draws)).tolist()
    k0, k1 = generator.keys
    expected = []
    for i in draws:  # pure-Python MurmurHash3 finalizer chain, 53 bits
        high = _mix32(_mix32(i ^ k0) ^ k1)
        low = _mix32(high ^ k0 ^ 0x9E3779B9)
        expected.append(((high >> 6) * 2**27 + (low >> 5)) / 2**53)
    assert got == expected and all(0 <= u < 1 for u in got)
    copy = make_generator(None)
    copy.set_state(generator.get_state())
    assert (copy.seed, copy.keys) == (generator.seed, generator.keys)
    many = counter_uniforms(keys[:1].expand(20_000, 2), torch.arange(20_000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and many.unique().numel() == 20_000


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 0.9)])
def test_empirical_frequencies_match_the_filtered_softmax(temperature, top_k, top_p):
    draws = 40_000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    generator = make_generator(params.seed)
    tokens = sample(LOGITS.expand(draws, -1), rows([params] * draws, [generator] * draws, range(draws)))
    frequencies = torch.bincount(tokens, minlength=5).float() / draws
    # Independent expectation from the hand-made probabilities.
    expected = PROBS ** (1 / temperature)
    if top_k:
        expected[expected.argsort(descending=True)[top_k:]] = 0
    expected /= expected.sum()
    order = expected.argsort(descending=True)
    mass_before = torch.cumsum(expected[order], 0) - expected[order]
    expected[order[mass_before >= top_p]] = 0
    expected /= expected.sum()
    assert torch.all(frequencies[expected == 0] == 0)
    torch.testing.assert_close(frequencies, expected, atol=4 * math.sqrt(0.25 / draws), rtol=0)


def test_logprobs_of_chosen_and_top_tokens():
    logits = torch.stack([LOGITS, LOGITS + 3.0])  # a shift does not change log-probabilities
    torch.testing.assert_close(token_logprobs(logits, torch.tensor([3, 1])), PROBS[[3, 1]].log())
    values, ids = top_logprobs(logits, 2)
    assert ids.tolist() == [[1, 3], [1, 3]]
    torch.testing.assert_close(values, PROBS[[1, 3]].log().expand(2, -1))


def test_prompt_logprobs_score_each_next_token():
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    torch.testing.assert_close(
        prompt_logprobs(logits, torch.tensor([0, 4, 2])), torch.stack([PROBS[4], PROBS[2]]).log()
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0 (0 means greedy), got -0.1"),
        (dict(temperature=math.inf), "temperature must be a finite number >= 0 (0 means greedy), got inf"),
        (dict(top_k=-1), "top_k must be an integer >= 0 (0 disables top-k), got -1"),
        (dict(top_k=2.5), "top_k must be an integer >= 0 (0 disables top-k), got 2.5"),
        (dict(top_p=0.0), "top_p must be a number in (0, 1] (1 disables top-p), got 0.0"),
        (dict(top_p=1.5), "top_p must be a number in (0, 1] (1 disables top-p), got 1.5"),
        (dict(seed=-1), "seed must be None or an integer in [0, 2**64), got -1"),
        (dict(max_tokens=0), "max_tokens must be None or an integer >= 1, got 0"),
        (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs must be an integer in [0, 20], got 21"),
        (dict(top_logprobs=2), "top_logprobs=2 needs logprobs=True"),
    ],
)
def test_invalid_params_fail_with_their_message(kwargs, message):
    with pytest.raises(InvalidSamplingParamsError) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == message


def test_stop_is_normalized_and_validated():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(
        InvalidStopSequencesError,
        match=r"stop must be a non-empty string or a list of non-empty strings, got \['a', ''\]",
    ):
        SamplingParams(stop=["a", ""])


def test_mismatched_inputs_are_refused():
    with pytest.raises(SamplingInputError, match=r"got logits of shape \(2, 5\) and 1 rows of parameters"):
        sample(torch.zeros(2, 5), rows([SamplingParams(seed=1)], [make_generator(1)], [0]))
    with pytest.raises(SamplingInputError, match="got 1, 1 and 2"):
        rows([SamplingParams()], [None], [0, 1])
    with pytest.raises(SamplingInputError, match="every row with temperature > 0 needs a generator"):
        rows([SamplingParams()], [None], [0])
