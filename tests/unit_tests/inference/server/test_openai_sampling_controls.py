"""Every sampling control through the real ``openai`` client against the real server and engine
(a tiny random GPT over the byte-level vocabulary, one server for the module's one test), each
checked for its effect: logit_bias forcing a token, penalties giving exactly the tokens of the
hand formulas on the model's logits, min_tokens holding back an EOS that logit_bias forces, min_p
keeping only the top token, best_of returning the candidate of highest cumulative log-prob (and
usage counting every candidate); completions and chat, streamed and not; bad values answer 400
with the message naming the field."""

import openai
import pytest

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.server.chat_template import default_chat_prompt
from tests.unit_tests.inference.engines.common import gpt_model, prompts
from tests.unit_tests.inference.engines.test_sampling_controls import reference_controlled_greedy
from tests.unit_tests.transformer.single_rank import on_single_rank

from .harness import TOKENIZER, openai_server

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.5)
EXTRA = dict(repetition_penalty=1.5)  # not in the openai client's signature: sent as extra_body
X = TOKENIZER.tokenize("X")[0]
EOS = TOKENIZER.eos


def _text(api, stream: bool, **request) -> tuple[str, list]:
    """Completion text (streamed chunks joined) and the response(s)."""
    if not stream:
        response = api.completions.create(model="megatron", **request)
        return response.choices[0].text, [response]
    chunks = list(api.completions.create(model="megatron", stream=True, **request))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def _chat_text(api, stream: bool, **request) -> str:
    if not stream:
        return api.chat.completions.create(model="megatron", **request).choices[0].message.content or ""
    chunks = api.chat.completions.create(model="megatron", stream=True, **request)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@on_single_rank
def test_every_sampling_control_through_the_openai_client(pg):
    model = gpt_model(pg, vocab_size=TOKENIZER.vocab_size)
    engine = DynamicInferenceEngine(
        model,
        max_tokens_per_step=64,
        block_size=4,
        num_blocks=96,
        max_requests=8,
        max_sequence_length=64,
        tokenizer=TOKENIZER,
        pg_collection=pg,
    )
    prompt = [t % 96 + 32 for t in prompts([6])[0]]  # printable bytes
    messages = [{"role": "user", "content": "hi"}]
    chat_prompt = TOKENIZER.tokenize(default_chat_prompt(messages))
    penalized = SamplingParams(temperature=0.0, max_tokens=12, **PENALTIES, **EXTRA)
    want_penalized = reference_controlled_greedy(model, prompt, penalized)
    want_chat_penalized = reference_controlled_greedy(model, chat_prompt, penalized)
    want_greedy = reference_controlled_greedy(model, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    assert want_penalized != want_greedy  # the penalties change the tokens of this prompt
    stop_at_x = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={X: 100}, stop_token_ids=[X], min_tokens=3)
    want_stop_at_x = reference_controlled_greedy(model, prompt, stop_at_x)
    assert len(want_stop_at_x) == 4 and want_stop_at_x[-1] == X
    with openai_server([engine]) as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            # logit_bias forces a token, whatever the temperature.
            forced, _ = _text(api, stream, prompt=prompt, max_tokens=5, temperature=1.0, logit_bias={str(X): 100})
            assert forced == "XXXXX", stream
            chat = _chat_text(api, stream, messages=messages, max_tokens=4, temperature=1.0, logit_bias={str(X): 100})
            assert chat == "XXXX", stream
            # Penalties: exactly the tokens of the hand formulas on the model's logits.
            text, _ = _text(api, stream, prompt=prompt, max_tokens=12, temperature=0, extra_body=EXTRA, **PENALTIES)
            assert text == TOKENIZER.detokenize(want_penalized), stream
            chat = _chat_text(
                api, stream, messages=messages, max_tokens=12, temperature=0, extra_body=EXTRA, **PENALTIES
            )
            assert chat == TOKENIZER.detokenize(want_chat_penalized), stream
            # min_p=1 keeps only the most likely token: a sampled request gives the greedy tokens.
            text, _ = _text(
                api, stream, prompt=prompt, max_tokens=12, temperature=1.0, seed=3, extra_body={"min_p": 1.0}
            )
            assert text == TOKENIZER.detokenize(want_greedy), stream
            # An EOS forced by logit_bias ends at once; min_tokens holds it back for 5 tokens.
            for min_tokens, want_tokens in ((0, 1), (5, 6)):
                text, responses = _text(
                    api,
                    stream,
                    prompt=prompt,
                    max_tokens=10,
                    temperature=0,
                    logit_bias={str(EOS): 100},
                    extra_body={"min_tokens": min_tokens},
                    stream_options={"include_usage": True} if stream else None,
                )
                usage = responses[-1].usage
                assert usage.completion_tokens == want_tokens and len(text) == want_tokens - 1, (stream, min_tokens)
                assert text == TOKENIZER.detokenize(want_greedy[: want_tokens - 1])
            # stop_token_ids end like EOS (the token counted, no text), not before min_tokens.
            for min_tokens, want in ((0, [X]), (3, want_stop_at_x)):
                text, responses = _text(
                    api,
                    stream,
                    prompt=prompt,
                    max_tokens=10,
                    temperature=0,
                    logit_bias={str(X): 100},
                    extra_body={"stop_token_ids": [X], "min_tokens": min_tokens},
                    stream_options={"include_usage": True} if stream else None,
                )
                assert responses[-1].usage.completion_tokens == len(want), (stream, min_tokens)
                assert text == TOKENIZER.detokenize(want[:-1])
        # best_of: the candidate of highest cumulative log-prob; usage counts all candidates.
        candidates = []
        for i in range(3):  # choice i of a seeded request is seeded with seed + i
            single = api.completions.create(
                model="megatron", prompt=prompt, max_tokens=6, temperature=1.0, seed=11 + i, logprobs=0
            )
            candidates.append((sum(single.choices[0].logprobs.token_logprobs), single.choices[0].text))
        best = api.completions.create(
            model="megatron", prompt=prompt, max_tokens=6, temperature=1.0, seed=11, best_of=3
        )
        assert len({text for _, text in candidates}) > 1  # the candidates differ
        assert [c.text for c in best.choices] == [max(candidates)[1]] and best.choices[0].logprobs is None
        assert best.usage.completion_tokens == 18
        two = api.completions.create(
            model="megatron", prompt=prompt, max_tokens=6, temperature=1.0, seed=11, best_of=3, n=2, logprobs=0
        )
        ranked = sorted(candidates, key=lambda c: -c[0])
        assert [c.text for c in two.choices] == [text for _, text in ranked[:2]]
        assert [c.index for c in two.choices] == [0, 1]
        # Bad values: 400 naming the field.
        bad = [
            (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2] (0 disables), got 2.5"),
            (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty must be a finite number > 0"),
            (dict(extra_body={"min_p": -0.5}), "min_p must be a number in [0, 1] (0 disables), got -0.5"),
            (dict(extra_body={"min_tokens": 9}, max_tokens=4), "min_tokens=9 must be at most max_tokens=4"),
            (dict(logit_bias={"7": 101}), "logit_bias values must be numbers in [-100, 100], got 101.0 for token 7"),
            (dict(logit_bias={"seven": 1}), "logit_bias keys must be token ids (integers >= 0), got 'seven'"),
            (dict(logit_bias={"999": 1}), "logit_bias holds token ids [999] outside the vocabulary"),
            (dict(best_of=1, n=2), "best_of=1 must be at least n=2"),
            (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids must be a list of token ids"),
            (dict(extra_body={"stop_token_ids": [500]}), "stop_token_ids holds token ids [500] outside the vocabulary"),
            (dict(best_of=2, stream=True), "best_of=2 > n=1 cannot be streamed"),
            # Defined by OpenAI / vLLM but not implemented here: refused, never silently ignored.
            (dict(suffix="}"), "suffix is not supported (no fill-in-the-middle)"),
            (dict(extra_body={"prompt_logprobs": 2}), "prompt_logprobs is not supported; send echo=true"),
        ]
        for request, message in bad:
            request = dict(dict(prompt=prompt, max_tokens=4), **request)
            with pytest.raises(openai.BadRequestError) as error:
                response = api.completions.create(model="megatron", **request)
                list(response) if request.get("stream") else None
            assert error.value.body["message"].startswith(message), (request, error.value.body)
