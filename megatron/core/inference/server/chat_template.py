"""Chat messages -> prompt text: a Jinja chat template (the tokenizer's own, or ``--chat-template``)
rendered by transformers' ``apply_chat_template``, else our plain template.

The built-in template marks each turn ``<|role|>\\n...<|end|>\\n`` and ends with an open
assistant turn. Offered tools are described in a system turn that asks for Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls (what the default
``hermes`` tool-call parser reads).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron.core.errors import MegatronConfigError
from megatron.core.tokenizers import HuggingFaceTokenizer, TokenizerError

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


PLAIN = "plain"


class ChatTemplateError(MegatronConfigError):
    """A ``--chat-template`` that names neither a readable file nor a built-in template."""


def check_chat_template(override: str | None) -> None:
    """Raise ChatTemplateError unless ``override`` is None, a built-in name or a file."""
    if override is not None and override != PLAIN and not Path(override).is_file():
        raise ChatTemplateError(
            f"--chat-template {override!r} is neither a file nor a built-in template; give a Jinja file or {PLAIN!r}"
        )


def _jinja_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF chat templates read them: text content, tool-call arguments as objects."""
    shaped = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part.get("text", "") for part in message["content"])
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
                for call in message["tool_calls"]
            ]
        shaped.append(message)
    return shaped


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # the template gets the text the client sent


class ChatTemplate:
    """How a chat becomes prompt text: a Jinja template through transformers'
    ``apply_chat_template`` (offered tools and per-request ``chat_template_kwargs`` go to the
    template), or our plain template (tools described in a system turn).

    Args:
        tokenizer: the served tokenizer; a :class:`HuggingFaceTokenizer` with a ``chat_template``
            in its tokenizer_config.json brings its own template.
        override: ``--chat-template``: a Jinja file, or a built-in name (``"plain"``); None: the
            tokenizer's template if it has one, else the plain one.
    """

    def __init__(self, tokenizer, override: str | None = None):
        self.tokenizer = tokenizer
        self.jinja = self._template_text(tokenizer, override)
        self._hf = None
        if self.jinja is not None:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            if isinstance(tokenizer, HuggingFaceTokenizer):  # its special tokens reach the template
                self._hf = AutoTokenizer.from_pretrained(str(tokenizer.tokenizer_file.parent), local_files_only=True)
            else:
                self._hf = PreTrainedTokenizerFast(tokenizer_object=_EmptyVocabulary.build())

    @staticmethod
    def _template_text(tokenizer, override: str | None) -> str | None:
        check_chat_template(override)
        if override is None:
            return getattr(tokenizer, "chat_template", None) or None
        return None if override == PLAIN else Path(override).read_text()

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat (a template's own errors raise TokenizerError)."""
        if self.jinja is None:
            return default_chat_prompt(with_tools(messages, tools), add_generation_prompt)
        try:
            return self._hf.apply_chat_template(
                _jinja_messages(messages),
                tools=list(tools) if tools else None,
                chat_template=self.jinja,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # a template raises what it likes (TemplateError, TypeError...)
            raise TokenizerError(f"the chat template failed on these messages: {exc}") from exc


class _EmptyVocabulary:
    """A tokenizer object for transformers when ours is not a HuggingFace one: rendering a
    template needs none of its tokens."""

    @staticmethod
    def build():
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        return Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
