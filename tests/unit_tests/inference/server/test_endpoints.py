"""/v1/models/{id}, /tokenize, /detokenize, /version and /v1/embeddings through the real `openai` client."""

import openai
import pytest

import megatron
from megatron.core.inference.server.chat_template import default_chat_prompt, with_tools

from .harness import TOKENIZER, app_server, openai_server

MAX_MODEL_LEN = 4096
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture(scope="module")
def server():
    with openai_server(max_model_len=MAX_MODEL_LEN) as (server, coordinator):
        yield server, coordinator


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def root(server):
    """The same client on the server's root, for vLLM's routes outside /v1."""
    return openai.OpenAI(base_url=server[0].url, api_key="unused", max_retries=0)


def test_models_retrieve_returns_the_served_model_and_404s_others(api):
    model = api.models.retrieve("megatron")
    assert (model.id, model.object, model.owned_by, model.max_model_len) == ("megatron", "model", "megatron", 4096)
    assert api.models.list().data == [model]
    with pytest.raises(openai.NotFoundError) as info:
        api.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and "'megatron'" in info.value.body["message"]


def test_tokenize_a_prompt_with_and_without_token_strings(root):
    result = root.post("/tokenize", body={"model": "megatron", "prompt": "héllo"}, cast_to=object)
    tokens = TOKENIZER.tokenize("héllo")
    assert result == {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": None}
    result = root.post("/tokenize", body={"prompt": "ab", "return_token_strs": True}, cast_to=object)
    assert result["tokens"] == [ord("a"), ord("b")] and result["token_strs"] == ["a", "b"]


def test_tokenize_messages_gives_the_prompt_a_chat_completion_sees(api, root):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}]
    result = root.post("/tokenize", body={"messages": messages, "tools": [WEATHER_TOOL]}, cast_to=object)
    expected = TOKENIZER.tokenize(default_chat_prompt(with_tools(messages, [WEATHER_TOOL])))
    assert result["tokens"] == expected and result["count"] == len(expected)
    usage = api.chat.completions.create(model="megatron", messages=messages, tools=[WEATHER_TOOL], max_tokens=1).usage
    assert usage.prompt_tokens == len(expected)
    open_turn = root.post("/tokenize", body={"messages": messages, "add_generation_prompt": False}, cast_to=object)
    assert open_turn["tokens"] == TOKENIZER.tokenize(default_chat_prompt(messages, add_generation_prompt=False))


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(root):
    tokens = root.post("/tokenize", body={"prompt": "round trip ✓"}, cast_to=object)["tokens"]
    assert root.post("/detokenize", body={"model": "megatron", "tokens": tokens}, cast_to=object) == {
        "prompt": "round trip ✓"
    }
    with pytest.raises(openai.BadRequestError) as info:
        root.post("/detokenize", body={"tokens": [65, TOKENIZER.vocab_size]}, cast_to=object)
    assert info.value.body["param"] == "tokens" and str(TOKENIZER.vocab_size) in info.value.body["message"]


def test_tokenize_errors_name_the_field_of_the_shape_sent(root):
    with pytest.raises(openai.BadRequestError) as info:
        root.post("/tokenize", body={"prompt": 5}, cast_to=object)
    assert info.value.body["message"] == "prompt: Input should be a valid string"
    with pytest.raises(openai.BadRequestError) as info:
        root.post("/tokenize", body={"messages": []}, cast_to=object)
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        root.post("/tokenize", body={"model": "other", "prompt": "a"}, cast_to=object)


def test_version_reports_the_package_version(root):
    assert root.get("/version", cast_to=object) == {"version": megatron.__version__}


def test_embeddings_are_a_clear_404(api):
    with pytest.raises(openai.NotFoundError) as info:
        api.embeddings.create(model="megatron", input="text")
    assert info.value.body["code"] == "unsupported_endpoint"
    assert "does not compute embeddings" in info.value.body["message"]


def test_tokenize_needs_the_api_key_when_one_is_set(server):
    with app_server(server[1], api_key="sesame") as keyed:
        wrong = openai.OpenAI(base_url=keyed.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.post("/tokenize", body={"prompt": "a"}, cast_to=object)
        with pytest.raises(openai.AuthenticationError):
            wrong.post("/detokenize", body={"tokens": [65]}, cast_to=object)
        assert wrong.get("/version", cast_to=object) == {"version": megatron.__version__}
        right = openai.OpenAI(base_url=keyed.url, api_key="sesame", max_retries=0)
        assert right.post("/tokenize", body={"prompt": "a"}, cast_to=object)["tokens"] == [ord("a")]
