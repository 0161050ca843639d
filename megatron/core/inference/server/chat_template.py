"""Chat messages -> prompt text: the tokenizer's own chat template when it has one, else ours.

The built-in template marks each turn ``<|role|>\\n...<|end|>\\n`` and ends with an open
assistant turn. Offered tools are described in a system turn that asks for Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls (what the default
``hermes`` tool-call parser reads).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

TURN_END = "<|end|>"


def tool_instructions(tools: Sequence[dict[str, Any]]) -> str:
    """The system text that offers ``tools`` (OpenAI tool objects) to the model."""
    described = "\n".join(json.dumps(tool["function"], ensure_ascii=False, sort_keys=True) for tool in tools)
    return (
        "You may call these functions:\n"
        f"{described}\n"
        'To call one, answer <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.'
    )


def message_text(message: dict[str, Any]) -> str:
    """A message's text, with an assistant's earlier tool calls written back in call syntax."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content)
    for call in message.get("tool_calls") or ():
        function = call["function"]
        content += (
            f'<tool_call>{{"name": {json.dumps(function["name"])}, "arguments": {function["arguments"]}}}</tool_call>'
        )
    return content


def with_tools(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` with the tool instructions added to (or as) the leading system message."""
    if not tools:
        return messages
    instructions = tool_instructions(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": message_text(messages[0]) + "\n\n" + instructions}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def default_chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The built-in template: every turn, then an open assistant turn (when ``add_generation_prompt``)."""
    turns = [f"<|{message['role']}|>\n{message_text(message)}{TURN_END}\n" for message in messages]
    return "".join(turns) + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a chat: the tokenizer's ``apply_chat_template`` when it has a template."""
    messages = with_tools(messages, tools)
    if getattr(tokenizer, "chat_template", None):
        flat = [{"role": m["role"], "content": message_text(m)} for m in messages]
        return tokenizer.apply_chat_template(flat, add_generation_prompt=add_generation_prompt)
    return default_chat_prompt(messages, add_generation_prompt)
