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
# A UTF-8 character has at most 4 bytes and a token at least one, so a character still incomplete
# at the end of the text lies within its last 3 tokens: beyond that many, text is not held back.
MAX_HELD_TOKENS = 3


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas.

    The window of ids decoded is the previously emitted piece (context: tokenizers that render a
    token differently at the start of a text, e.g. SentencePiece's leading space, then decode the
    new ids as they would mid-text) followed by the ids not emitted yet. Text ending in U+FFFD (a
    multi-byte character split across tokens) is held back while at most :data:`MAX_HELD_TOKENS`
    ids are pending; past that, the longest prefix of the pending ids whose text ends on a whole
    character is emitted (or the first pending id when none does: its bytes cannot be completed by
    later tokens), so the window, and the work per token, stay bounded.

    Args:
        tokenizer: has ``detokenize(ids, skip_special_tokens=...)``.
        skip_special_tokens: passed to ``detokenize``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # context ids, then pending ids
        self._num_context = 0
        self._context_text: str | None = ""  # decoded context; None until needed again

    def add(self, token_id: int) -> str:
        """Append one token id; return the text it completes ("" while a character is incomplete)."""
        self._window.append(int(token_id))
        text = self._decode(len(self._window))
        if not text.endswith(REPLACEMENT_CHARACTER):
            return self._emit(len(self._window), text)
        if len(self._window) - self._num_context <= MAX_HELD_TOKENS:
            return ""
        for end in range(len(self._window) - 1, self._num_context + 1, -1):
            text = self._decode(end)
            if not text.endswith(REPLACEMENT_CHARACTER):
                return self._emit(end, text)
        end = self._num_context + 1
        return self._emit(end, self._decode(end))

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD); nothing stays pending."""
        return self._emit(len(self._window), self._decode(len(self._window)))

    def _emit(self, end: int, text: str) -> str:
        """Emit the text of the pending ids before ``end`` (``text`` decodes ``window[:end]``); they
        become the context of the next window."""
        if self._context_text is None:
            self._context_text = self._decode(self._num_context)
        delta = text[len(self._context_text) :]
        del self._window[: self._num_context]
        self._num_context = end - self._num_context
        self._context_text = None
        return delta

    def _decode(self, end: int) -> str:
        ids = self._window[:end]
        return self._tokenizer.detokenize(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""


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

    def add_token(self, token_id: int) -> bool:
        """Add the next generated token; True when a stop sequence completed with it."""
        return self._settle(self._detokenizer.add(token_id))

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

    def _settle(self, delta: str) -> bool:
        if self._matcher is None:
            self._settled.append(delta)
            return False
        check = self._matcher.feed(delta)
        self._settled.append(check.text)
        return check.stopped
