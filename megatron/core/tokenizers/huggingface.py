"""Wrapper around a HuggingFace ``tokenizer.json`` (the ``tokenizers`` library), no network."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# Looked up, in order, when tokenizer_config.json does not name the token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")


def resolve_tokenizer_file(tokenizer_model: str | Path | None) -> Path:
    """The tokenizer.json named by ``tokenizer_model``: the file itself or a directory holding it."""
    if tokenizer_model is None:
        raise TokenizerError(
            "HuggingFaceTokenizer needs --tokenizer-model: a path to tokenizer.json "
            "or to a directory containing tokenizer.json"
        )
    path = Path(tokenizer_model)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer model {str(tokenizer_model)!r} not found: expected a tokenizer.json file "
            f"or a directory containing {TOKENIZER_FILE}"
        )
    return path


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class HuggingFaceTokenizer(MegatronTokenizer):
    """Token ids from a ``tokenizer.json``; special tokens from the ``tokenizer_config.json``
    beside it when present, otherwise from the usual names (``<|endoftext|>``, ``</s>``, ...)."""

    def __init__(self, tokenizer_model: str | Path):
        from tokenizers import Tokenizer

        self.tokenizer_file = resolve_tokenizer_file(tokenizer_model)
        try:
            self._tokenizer = Tokenizer.from_file(str(self.tokenizer_file))
        except Exception as exc:  # the library raises a bare Exception on a malformed file
            raise TokenizerError(f"{self.tokenizer_file} is not a valid HuggingFace tokenizer.json: {exc}") from exc
        config_path = self.tokenizer_file.parent / CONFIG_FILE
        self._config: dict = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        eod = self._special_id("eos_token", EOS_CANDIDATES)
        if eod is None:
            raise TokenizerError(
                f"{self.tokenizer_file} has no end-of-document token: set eos_token in "
                f"{CONFIG_FILE} or include one of {', '.join(EOS_CANDIDATES)}"
            )
        self._eod = eod
        self._bos = self._special_id("bos_token", BOS_CANDIDATES)
        self._pad = self._special_id("pad_token", PAD_CANDIDATES)

    def _special_id(self, config_key: str, candidates: Sequence[str]) -> int | None:
        configured = _token_text(self._config.get(config_key))
        names = (configured,) if configured is not None else candidates
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        if configured is not None:
            raise TokenizerError(
                f"{CONFIG_FILE} sets {config_key}={configured!r}, which is not in the vocabulary of "
                f"{self.tokenizer_file}"
            )
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath (vocabulary, added tokens, decoder)."""
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise TokenizerError(
                f"token ids {bad[:5]} are outside the vocabulary of {self.tokenizer_file}; "
                f"accepted ids are 0..{self._vocab_size - 1}"
            )
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int | None:
        return self._pad

    @property
    def add_bos(self) -> bool:
        """``add_bos_token`` of tokenizer_config.json; without it, whether tokenizer.json's own
        post-processor puts the BOS in front."""
        if self._bos is None:
            return False
        configured = self._config.get("add_bos_token")
        if configured is not None:
            return bool(configured)
        return self._tokenizer.encode("a", add_special_tokens=True).ids[:1] == [self._bos]

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template of tokenizer_config.json, if it has one."""
        return self._config.get("chat_template")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = False
    ) -> str | list[int]:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the config's chat template,
        in a sandboxed Jinja environment; returns the text, or its ids when ``tokenize``."""
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.tokenizer_file.parent / CONFIG_FILE} has no chat_template; "
                "chat formatting needs a tokenizer_config.json with a chat_template entry"
            )
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TokenizerError(f"chat template rejected the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(self._config.get("bos_token")) or "",
            eos_token=_token_text(self._config.get("eos_token")) or "",
        )
        return self.tokenize(text) if tokenize else text
