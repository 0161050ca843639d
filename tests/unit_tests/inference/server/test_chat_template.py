"""Chat prompts: the tokenizer's own template when it has one, the built-in one otherwise."""

import json

from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from megatron.core.inference.server.chat_template import render_chat
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer

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
    assert render_chat(ByteLevelTokenizer(), messages, [TOOL]) == (
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
    tokenizer = HuggingFaceTokenizer(tmp_path)
    assert render_chat(tokenizer, [{"role": "user", "content": "hi"}]) == "[user]hi[assistant]"
    assert (
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], [TOOL]) == f"[system]{TOOL_TEXT}[user]hi[assistant]"
    )
