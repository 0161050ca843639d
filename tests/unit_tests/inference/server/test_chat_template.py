"""Chat prompts: the tokenizer's own template when it has one, the built-in one otherwise."""

import json

import openai
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoTokenizer

from megatron.core.inference.coordinator import InferenceClient
from megatron.core.inference.prompts import tokenize_prompt
from megatron.core.inference.server import ServerConfig, ServerThread, launcher
from megatron.core.inference.server.chat_template import ChatTemplate, ChatTemplateError, default_chat_prompt
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer

from ...tokenizers.tiny_hf_tokenizer import BOS, EOS, train_tiny_tokenizer
from ..coordinator.cluster import running_cluster
from ..coordinator.engine_double import HashEngine, expected_tokens
from .harness import TOKENIZER, openai_server

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_TEXT = (
    'You may call these functions:\n{"name": "f", "parameters": {"type": "object"}}\n'
    'To call one, answer <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.'
)


def test_builtin_template_marks_turns_and_writes_back_tool_calls():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c"},
    ]
    assert ChatTemplate(ByteLevelTokenizer()).render(messages, [TOOL]) == (
        f"<|system|>\nbe brief\n\n{TOOL_TEXT}<|end|>\n"
        "<|user|>\nab<|end|>\n"
        '<|assistant|>\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><|end|>\n'
        "<|tool|>\n42<|end|>\n"
        "<|assistant|>\n"
    )


def test_a_huggingface_chat_template_is_used_when_present(tmp_path):
    Tokenizer(WordLevel({"<eos>": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))
    template = ChatTemplate(HuggingFaceTokenizer(tmp_path))
    assert template.render([{"role": "user", "content": "hi"}]) == "[user]hi[assistant]"
    # Tools go to the template, which decides how to show them (this one does not).
    assert template.render([{"role": "user", "content": "hi"}], [TOOL]) == "[user]hi[assistant]"


# A Qwen-style template (written for this test): tools in a system turn, tool calls written back,
# and an empty thinking block when the request sets enable_thinking=False.
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen_style")
    train_tiny_tokenizer(directory, config={"eos_token": EOS, "bos_token": BOS, "chat_template": QWEN_STYLE})
    return directory


@pytest.fixture(scope="module")
def hf_server(hf_dir):
    with running_cluster([HashEngine()]) as coordinator:
        client = InferenceClient(coordinator.address)
        with ServerThread(client, tokenizer=HuggingFaceTokenizer(hf_dir), config=ServerConfig()) as server:
            yield server


def reference_prompt(hf_dir, tools, **kwargs) -> str:
    """transformers' own rendering of CONVERSATION (tool-call arguments as objects, as HF templates read them)."""
    messages = [dict(m) for m in CONVERSATION]
    messages[2] = {**messages[2], "tool_calls": [{**CONVERSATION[2]["tool_calls"][0]}]}
    messages[2]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": {"city": "Paris"}}
    reference = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    return reference.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)


@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no_tools", "tools"])
def test_the_prompt_equals_transformers_apply_chat_template(hf_dir, hf_server, tools, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected_text = reference_prompt(hf_dir, tools, **kwargs)
    assert ("<think>" in expected_text) == (thinking is False)
    assert ('"name": "get_weather"' in expected_text.split("<|im_start|>user")[0]) == bool(tools)
    root = openai.OpenAI(base_url=hf_server.url, api_key="unused", max_retries=0)
    body = {"messages": CONVERSATION, "tools": tools, "chat_template_kwargs": kwargs or None}
    result = root.post("/tokenize", body={k: v for k, v in body.items() if v is not None}, cast_to=object)
    expected = tokenize_prompt(HuggingFaceTokenizer(hf_dir), expected_text)
    assert result["tokens"] == expected
    assert HuggingFaceTokenizer(hf_dir).detokenize(result["tokens"], skip_special_tokens=False).endswith(expected_text)


def test_a_chat_completion_sees_the_templated_prompt(tmp_path):
    template_file = tmp_path / "template.jinja"
    template_file.write_text(QWEN_STYLE)
    messages = [{"role": "user", "content": "hi"}]
    with openai_server(chat_template=str(template_file)) as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        result = api.chat.completions.create(
            model="megatron",
            messages=messages,
            max_tokens=3,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert result.usage.prompt_tokens == len(TOKENIZER.tokenize(prompt))
    assert result.choices[0].message.content == TOKENIZER.detokenize(expected_tokens(TOKENIZER.tokenize(prompt), 3))


def test_chat_template_plain_overrides_the_tokenizers_own(hf_dir):
    template = ChatTemplate(HuggingFaceTokenizer(hf_dir), "plain")
    assert template.render([{"role": "user", "content": "hi"}]) == default_chat_prompt(
        [{"role": "user", "content": "hi"}]
    )


def test_an_unknown_chat_template_is_a_config_error(tmp_path):
    with pytest.raises(ChatTemplateError, match=r"--chat-template 'chatml2' is neither a file nor a built-in"):
        ServerConfig(chat_template="chatml2")
    assert launcher.main(["--load", str(tmp_path), "--chat-template", "nope"]) == 2


def test_a_failing_template_is_a_400(hf_dir, hf_server):
    api = openai.OpenAI(base_url=hf_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        # chat_template_kwargs may not override what the server passes itself (here the tools).
        api.chat.completions.create(
            model="megatron",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"chat_template_kwargs": {"tools": 5}},
        )
    assert info.value.body["param"] == "messages" and "chat template failed" in info.value.body["message"]
