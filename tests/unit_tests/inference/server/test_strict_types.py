"""Strict request types through the real `openai` client: integers, booleans and finite numbers
only, each refusal a 400 naming the field; usage counts exactly the tokens a choice returns."""

import httpx
import openai
import pytest

from ..coordinator.engine_double import expected_tokens
from .harness import TOKENIZER, openai_server

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with openai_server() as (server, _):
        yield server


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value.body


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", "10", "max_tokens: Input should be a valid integer"),
        ("max_tokens", 10.0, "max_tokens: Input should be a valid integer"),
        ("max_tokens", True, "max_tokens: Input should be a valid integer"),
        ("n", "2", "n: Input should be a valid integer"),
        ("seed", False, "seed: Input should be a valid integer"),
        ("logprobs", "1", "logprobs: Input should be a valid integer"),
        ("temperature", True, "temperature: Input should be a valid number"),
        ("temperature", "0.5", "temperature: Input should be a valid number"),
        ("echo", 1, "echo: Input should be a valid boolean"),
        ("stream", "false", "stream: Input should be a valid boolean"),
    ],
)
def test_completion_fields_of_the_wrong_type_are_400_naming_the_field(api, field, value, message):
    kwargs = {"model": "megatron", "prompt": "a", "max_tokens": 2, field: value}
    body = refused(lambda: api.completions.create(**kwargs))
    assert body["message"] == message and body["param"] == field and body["code"] == "invalid_value"


@pytest.mark.parametrize(
    "prompt, where",
    [
        ([True, False], "element 0 is a boolean, not a token id"),
        ([1, 2.5], "element 1 is a number, not a token id"),
        ([[1, 2], [3, True]], "element 1.1 is a boolean, not a token id"),
        (["a", [1]], "mixes strings and token-id lists"),
        (["a", None], "element 1 is null"),
        ({"text": "a"}, "is an object"),
    ],
)
def test_prompts_of_the_wrong_shape_name_the_element_at_fault(api, prompt, where):
    body = refused(lambda: api.completions.create(model="megatron", prompt=prompt, max_tokens=2))
    assert body["param"] == "prompt"
    assert body["message"] == f"prompt: {where}; send a string, a list of strings, a list of token ids " + (
        "(integers), or a list of token-id lists"
    )


def test_chat_fields_of_the_wrong_type_are_400(api):
    body = refused(lambda: api.chat.completions.create(model="megatron", messages=CHAT, logprobs=1))
    assert body["message"] == "logprobs: Input should be a valid boolean"
    body = refused(lambda: api.chat.completions.create(model="megatron", messages=CHAT, max_completion_tokens="3"))
    assert body["message"] == "max_completion_tokens: Input should be a valid integer"
    body = refused(
        lambda: api.chat.completions.create(
            model="megatron", messages=CHAT, stream=True, stream_options={"include_usage": "yes"}
        )
    )
    assert body["message"] == "stream_options.include_usage: Input should be a valid boolean"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_non_finite_numbers_are_refused_as_not_finite(server, field, literal):
    # JSON has no NaN, but Python's JSON reader (and so the server's) accepts these literals.
    content = f'{{"model": "megatron", "prompt": "a", "{field}": {literal}}}'.encode()
    response = httpx.post(
        server.url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=10
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"{field}: Input should be a finite number"


def test_integral_numbers_are_still_numbers(api):
    result = api.completions.create(model="megatron", prompt="a", max_tokens=2, temperature=0, top_p=1)
    assert result.choices[0].text == TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize("a"), 2))


def test_usage_counts_exactly_the_returned_tokens_when_a_stop_string_ends_the_choice(api):
    full = TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize("count me"), 40))
    stop = full[6:8]
    for stream in (False, True):
        kwargs = dict(model="megatron", prompt="count me", max_tokens=40, stop=stop, logprobs=0, n=2, seed=1)
        if stream:
            chunks = list(api.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            returned = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            result = api.completions.create(**kwargs)
            returned = sum(len(choice.logprobs.tokens) for choice in result.choices)
            usage = result.usage
        # Each choice returned the tokens up to the one completing the stop string, text cut before it.
        assert returned == usage.completion_tokens == 2 * (full.index(stop) + len(stop))
        assert usage.prompt_tokens == len("count me")  # one prompt, whatever n
