"""The real DynamicInferenceEngine (tiny random GPT) behind the coordinator and the HTTP server:
text, stop sequences, usage and top log-probs come from the engine's outputs."""

import openai
import pytest
import torch

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.engines.errors import MaxSequenceLengthOverflowError
from megatron.core.inference.server.chat_template import default_chat_prompt
from megatron.core.inference.server.responses import token_text
from tests.unit_tests.dist_harness import device
from tests.unit_tests.inference.engines.common import gpt_model, prompts, reference_greedy
from tests.unit_tests.transformer.single_rank import on_single_rank

from .harness import TOKENIZER, openai_server


@on_single_rank
def test_greedy_completions_match_a_cache_free_reference_and_admission_errors_are_4xx(pg):
    model = gpt_model(pg)
    engine = DynamicInferenceEngine(
        model,
        max_tokens_per_step=32,
        block_size=4,
        num_blocks=64,
        max_requests=8,
        max_sequence_length=48,
        tokenizer=TOKENIZER,
        pg_collection=pg,
    )
    requests = prompts([5, 9, 3])
    reference = [reference_greedy(model, prompt, 6) for prompt in requests]
    with openai_server([engine]) as (server, coordinator):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = api.completions.create(model="megatron", prompt=requests, max_tokens=6, temperature=0, logprobs=1)
        streamed = api.completions.create(
            model="megatron", prompt=requests[0], max_tokens=6, temperature=0, stream=True
        )
        streamed_text = "".join(chunk.choices[0].text for chunk in streamed)
        full_text = TOKENIZER.detokenize(reference[1])
        stop = full_text[2:4]
        stopped = api.completions.create(model="megatron", prompt=requests[1], max_tokens=6, temperature=0, stop=stop)
        with pytest.raises(openai.APIStatusError) as too_long:
            api.completions.create(model="megatron", prompt=[1] * 40, max_tokens=20)
        assert coordinator.router.routes == {}
    assert [choice.text for choice in whole.choices] == [TOKENIZER.detokenize(tokens) for tokens in reference]
    assert all(len(choice.logprobs.token_logprobs) == 6 for choice in whole.choices)
    assert whole.usage.completion_tokens == 18 and whole.usage.prompt_tokens == 17
    assert streamed_text == TOKENIZER.detokenize(reference[0])
    # The engine ends the request at the token that completes the stop; usage counts exactly those.
    assert stopped.choices[0].text == full_text[: full_text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == full_text.index(stop) + len(stop)  # one byte per character
    assert too_long.value.status_code == 400
    expected = MaxSequenceLengthOverflowError(prompt_length=40, max_tokens=20, max_sequence_length=48)
    assert too_long.value.body == {
        "message": str(expected),
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }


@on_single_rank
def test_an_engine_without_a_tokenizer_gets_a_clear_server_error(pg):
    engine = DynamicInferenceEngine(
        gpt_model(pg), max_tokens_per_step=32, block_size=4, num_blocks=64, max_sequence_length=48, pg_collection=pg
    )
    with openai_server([engine]) as (server, coordinator):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as error:
            api.completions.create(model="megatron", prompt=prompts([5])[0], max_tokens=4, temperature=0)
    assert error.value.status_code == 500
    assert (
        error.value.body["message"] == "the engine reports tokens without text: serve an engine built with a tokenizer"
    )


@torch.no_grad()
def _model_top_log_probs(model, prompt: list[int], num_tokens: int, count: int) -> list[list[tuple[str, float]]]:
    """Greedy generation by cache-free forwards; per generated position, the ``count`` most likely
    tokens (as text) and their log-probs: a log-softmax of the model's logits."""
    tokens, tops = list(prompt), []
    for _ in range(num_tokens):
        logits = model(torch.tensor([tokens], device=device()))[0, -1, : TOKENIZER.vocab_size].float()
        values, ids = torch.log_softmax(logits, dim=-1).topk(count)
        tops.append([(token_text(TOKENIZER, i), v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)])
        tokens.append(int(ids[0]))
    return tops


@on_single_rank
def test_top_logprobs_through_completions_and_chat_are_the_models_log_softmax(pg):
    model = gpt_model(pg, vocab_size=TOKENIZER.vocab_size)
    engine = DynamicInferenceEngine(
        model,
        max_tokens_per_step=64,
        block_size=4,
        num_blocks=64,
        max_requests=4,
        tokenizer=TOKENIZER,
        pg_collection=pg,
    )
    messages = [{"role": "user", "content": "hi"}]
    chat_prompt = TOKENIZER.tokenize(default_chat_prompt(messages))
    prompt = prompts([7])[0]
    with openai_server([engine]) as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = api.chat.completions.create(
            model="megatron", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=5
        )
        completion = api.completions.create(model="megatron", prompt=prompt, max_tokens=4, temperature=0, logprobs=5)
    chat_expected = _model_top_log_probs(model, chat_prompt, 4, 5)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 5 for entry in content)
    for entry, expected in zip(content, chat_expected, strict=True):
        assert [top.token for top in entry.top_logprobs] == [text for text, _ in expected]
        torch.testing.assert_close(
            [top.logprob for top in entry.top_logprobs], [lp for _, lp in expected], rtol=0, atol=1e-5
        )
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the sampled token is the most likely
    completion_expected = _model_top_log_probs(model, prompt, 4, 5)
    tops = completion.choices[0].logprobs.top_logprobs
    assert len(tops) == 4
    for got, expected in zip(tops, completion_expected, strict=True):
        expected = dict(expected)  # texts of different ids may coincide, as in the server's mapping
        assert got.keys() == expected.keys()
        torch.testing.assert_close([got[text] for text in expected], list(expected.values()), rtol=0, atol=1e-5)
