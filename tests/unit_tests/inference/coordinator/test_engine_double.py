"""The serving tests' engine double against the real DynamicInferenceEngine: driven alike, it
reports outputs of the same type with the same fields, step by step, the same stats keys and
the same typed errors for the same bad requests. Only the token values (a hash) and their
log-probs (and top log-probs) differ. The double reports a step's tokens from the step that made
them, as the engine does with its steps run one by one (``overlap_steps=False``, the default off
CUDA; with overlapped steps, the default on one GPU, the engine reports them a step later)."""

import pytest

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.engines.requests import RequestOutput
from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.engines.common import gpt_model
from tests.unit_tests.transformer.single_rank import on_single_rank

from .engine_double import TOKENIZER, VOCAB_SIZE, HashEngine

MAX_SEQ = 48
REQUESTS = {
    "logprobs": ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, logprobs=True, return_prompt_logprobs=True)),
    "plain": ([4, 5], SamplingParams(temperature=0.0, max_tokens=2)),
    "top_logprobs": ([8, 9], SamplingParams(temperature=0.0, max_tokens=3, logprobs=True, top_logprobs=4)),
    "aborted": ([6], SamplingParams(temperature=0.9, seed=1, max_tokens=5, logprobs=True)),
    "to_the_limit": ([7] * 40, SamplingParams(temperature=0.0, return_prompt_logprobs=True)),
    "text": ("123", SamplingParams(temperature=0.0, max_tokens=2)),
}
BAD_REQUESTS = {
    "duplicate": ("plain", [1], SamplingParams()),
    "empty": ("e", [], SamplingParams()),
    "out_of_vocab": ("v", [VOCAB_SIZE], SamplingParams()),
    "too_long": ("t", [1] * (MAX_SEQ + 1), SamplingParams()),
    "overflow": ("o", [1] * 40, SamplingParams(max_tokens=9)),
    "not_token_ids": ("f", [1.5], SamplingParams()),
}


def _shapes(outputs: list[RequestOutput]) -> dict[str, dict]:
    """Everything about a step's outputs but token values and log-prob values, by request id."""
    shapes = {}
    for output in outputs:
        assert type(output) is RequestOutput
        data = output.to_dict()
        data["new_token_ids"] = len(data["new_token_ids"])
        data["new_log_probs"] = len(data["new_log_probs"])
        data["prompt_log_probs"] = None if data["prompt_log_probs"] is None else len(data["prompt_log_probs"])
        top = data["new_top_log_probs"]
        data["new_top_log_probs"] = None if top is None else [len(row) for row in top]
        data["new_text"] = type(data["new_text"]).__name__  # the text of other tokens differs
        shapes[data.pop("request_id")] = data
    return shapes


def _drive(engine) -> dict:
    steps = []
    for request_id, (prompt, params) in REQUESTS.items():
        engine.add_request(request_id, prompt, params)
    errors = {}
    for name, (request_id, prompt, params) in BAD_REQUESTS.items():
        with pytest.raises(InferenceRequestError) as err:
            engine.add_request(request_id, prompt, params)
        errors[name] = err.value.to_dict()
    steps.append(_shapes(engine.step()))
    engine.abort("aborted")
    while engine.has_unfinished_requests():
        steps.append(_shapes(engine.step()))
    return dict(steps=steps, errors=errors, stats_keys=sorted(engine.stats))


@on_single_rank
def test_the_double_reports_what_the_engine_reports(pg):
    real = DynamicInferenceEngine(
        gpt_model(pg, vocab_size=VOCAB_SIZE),
        tokenizer=TOKENIZER,
        block_size=4,
        max_tokens_per_step=64,
        max_sequence_length=MAX_SEQ,
        num_blocks=64,
        max_requests=8,
        overlap_steps=False,
        pg_collection=pg,
    )
    expected, got = _drive(real), _drive(HashEngine(max_sequence_length=MAX_SEQ))
    assert got["stats_keys"] == expected["stats_keys"]
    assert got["errors"] == expected["errors"]
    assert got["steps"] == expected["steps"]
    assert len(expected["steps"]) == MAX_SEQ - 40  # the long request decodes to the sequence limit
