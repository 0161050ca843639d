"""The interface every tokenizer offers to datasets, training and serving."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from megatron.core.errors import MegatronInputError


class TokenizerError(MegatronInputError):
    """A tokenizer that cannot be built or an input it cannot handle; the message says what is accepted."""


class MegatronTokenizer(ABC):
    """Text <-> token ids, plus the special ids the data pipeline needs.

    ``eod`` is the id appended after each document (and the end-of-sequence id for
    generation); ``bos`` and ``pad`` may be ``None`` when the vocabulary has no such token.
    """

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, specials included (ids are ``0 .. vocab_size - 1``)."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id."""

    @property
    @abstractmethod
    def bos(self) -> int | None:
        """Beginning-of-sequence id, or None."""

    @property
    @abstractmethod
    def pad(self) -> int | None:
        """Padding id, or None."""

    @property
    def add_bos(self) -> bool:
        """Whether a text prompt should start with ``bos`` (the tokenizer's own setting; False by default)."""
        return False

    @property
    def eos(self) -> int:
        """End-of-sequence id (the same token as ``eod``)."""
        return self.eod

    def fingerprint(self) -> str:
        """A short string that changes when the id assignment changes (used as a cache key)."""
        probe = "The quick brown fox\n\tjumps over 13 lazy dogs: é, 漢字, 🙂."
        ids = ",".join(map(str, self.tokenize(probe)))
        return f"{type(self).__name__}:{self.vocab_size}:{self.eod}:{self.bos}:{ids}"
