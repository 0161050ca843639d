"""What a prompt is, for every inference entry point: text or a sequence of int token ids.

Text is tokenized by the entry point's tokenizer, with exactly one BOS in front when the
tokenizer asks for one (``tokenizer.add_bos``; never a second one when the text already starts
with it, as a rendered chat template may). Token ids are used as given. Where there is no
tokenizer (the coordinator and its client route token ids only), text is refused with
:class:`PromptTypeError`, as is anything that is neither (``"123"`` is text, never the ids 1, 2, 3).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence

from megatron.core.inference.errors import RequestRejectedError


class PromptTypeError(RequestRejectedError):
    """A prompt that is neither text (where a tokenizer can read it) nor a sequence of int token ids."""

    fields = ("reason",)

    def describe(self, reason):
        return f"{reason}; a prompt is a string (where there is a tokenizer) or a list of int token ids"


def tokenize_prompt(tokenizer, text: str, *, add_bos: bool | None = None) -> list[int]:
    """The ids of a text prompt; one BOS in front when ``add_bos`` (None: when the tokenizer asks)."""
    ids = list(tokenizer.tokenize(text))
    if add_bos is None:
        add_bos = bool(getattr(tokenizer, "add_bos", False))
    if add_bos:
        if tokenizer.bos is None:
            raise PromptTypeError(reason="a BOS token was asked for but the tokenizer has none")
        if ids[:1] != [tokenizer.bos]:
            ids.insert(0, tokenizer.bos)
    return ids


def prompt_token_ids(prompt: str | Sequence[int], tokenizer=None, *, add_bos: bool | None = None) -> list[int]:
    """The token ids of ``prompt``: text through :func:`tokenize_prompt`, ids as given (any ints:
    Python, NumPy or one-element integer tensors). Raises :class:`PromptTypeError` otherwise."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptTypeError(reason="a text prompt needs a tokenizer and there is none here")
        return tokenize_prompt(tokenizer, prompt, add_bos=add_bos)
    if isinstance(prompt, (bytes, bytearray, Mapping)):
        raise PromptTypeError(reason=f"got type {type(prompt).__name__}")
    try:
        return [operator.index(t) for t in prompt]
    except TypeError:
        if not isinstance(prompt, Iterable):
            raise PromptTypeError(reason=f"got type {type(prompt).__name__}") from None
        kinds = sorted({type(t).__name__ for t in prompt if not hasattr(t, "__index__")})
        raise PromptTypeError(reason=f"the token list holds {', '.join(kinds)} values") from None
