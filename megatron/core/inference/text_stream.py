"""The text of a request's output, produced as its tokens are: incremental detokenization and
stop sequences in one place.

:class:`IncrementalDetokenizer` turns a growing list of token ids into text deltas that never
change once emitted, decoding only a window of recent ids (never the whole output again).
:class:`TextStream` feeds those deltas to a :class:`StopSequenceMatcher` and says at which token
generation stops. The engine owns one :class:`TextStream` per request and puts the settled text
on its outputs (``RequestOutput.new_text``), so the offline API, the HTTP server and the
disaggregated (handoff) path all read the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.inference.stop_words import StopSequenceMatcher

REPLACEMENT_CHARACTER = "\ufffd"
# An incomplete UTF-8 character at the end of a text has at most 3 bytes, and a token at least
# one, so it lies within the last 3 tokens; a window longer than _MAX_WINDOW is cut back to them.
_TAIL_TOKENS = 3
_MAX_WINDOW = 5


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas that never change once emitted.

    Each :meth:`add` decodes a short window of recent ids and emits the characters of its text
    past those already emitted, except the last one when it is U+FFFD: that may be a multi-byte
    character split across tokens, which a later token completes. After a token that ends on a
    whole character the window keeps only that token (as context: tokenizers that render a token
    differently at the start of a text, like SentencePiece's leading space, then render the next
    one as mid-text); while the text ends in U+FFFD the window grows, up to ``_MAX_WINDOW`` ids,
    then keeps the last ``_TAIL_TOKENS`` (which hold any incomplete character). So the ids decoded
    per token are bounded (about 3 for ordinary text, at most 6 on average for invalid UTF-8),
    and the deltas concatenate to the decode of the whole list (for tokens of at least one byte).

    Args:
        tokenizer: has ``detokenize(ids, skip_special_tokens=...)``.
        skip_special_tokens: passed to ``detokenize``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._emitted = 0  # characters of the window's text already emitted

    def add(self, token_id: int) -> str:
        """Append one token id; return the text it settles ("" while a character is incomplete)."""
        self._window.append(int(token_id))
        text = self._decode()
        settled = len(text) - text.endswith(REPLACEMENT_CHARACTER)
        delta = text[self._emitted : settled]
        self._emitted = max(self._emitted, settled)
        if settled == len(text):
            self._rebase(1, holds_incomplete=False)
        elif len(self._window) > _MAX_WINDOW:
            self._rebase(_TAIL_TOKENS, holds_incomplete=True)
        return delta

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD); resets the window."""
        delta = self._decode()[self._emitted :]
        self._window, self._emitted = [], 0
        return delta

    def _rebase(self, keep: int, holds_incomplete: bool) -> None:
        """Keep the last ``keep`` ids. Their text is emitted already, but for the trailing U+FFFD
        of a character they may still complete (``holds_incomplete``)."""
        if len(self._window) > keep:
            del self._window[:-keep]
            text = self._decode()
            self._emitted = len(text) - (holds_incomplete and text.endswith(REPLACEMENT_CHARACTER))

    def _decode(self) -> str:
        return self._tokenizer.detokenize(self._window, skip_special_tokens=self._skip_special_tokens)


class TextStream:
    """One request's output text: detokenized token by token, cut before the first stop sequence
    to complete (see :mod:`~megatron.core.inference.stop_words`).

    Call :meth:`add_token` for each generated token until it returns True (a stop sequence
    completed with that token) or generation ends otherwise, then :meth:`finish`. :meth:`take`
    returns the text settled since the previous take; the takes concatenate to the output text.

    Args:
        tokenizer: has ``detokenize``.
        stop: normalized stop sequences (``SamplingParams.stop``).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._matcher = StopSequenceMatcher(stop) if stop else None
        self._settled: list[str] = []

    def add_token(self, token_id: int, can_stop: bool = True) -> bool:
        """Add the next generated token; True when a stop sequence completed with it.
        ``can_stop=False`` (before ``min_tokens``): a stop sequence completed now is output as text."""
        return self._settle(self._detokenizer.add(token_id), can_stop)

    def finish(self) -> bool:
        """Generation ended without a stop sequence so far (EOS, length): settle the held-back text.
        True when that text completes a stop sequence after all."""
        if self._settle(self._detokenizer.flush()):
            return True
        if self._matcher is not None:
            self._settled.append(self._matcher.finish())
        return False

    def take(self) -> str:
        """The text settled since the previous call."""
        text = "".join(self._settled)
        self._settled.clear()
        return text

    def _settle(self, delta: str, can_stop: bool = True) -> bool:
        if self._matcher is None:
            self._settled.append(delta)
            return False
        check = self._matcher.feed(delta, can_stop)
        self._settled.append(check.text)
        return check.stopped
