"""Megatron's ``NullTokenizer``: no vocabulary, text is space-separated ids (for mock data and
benchmarks, ``--tokenizer-type NullTokenizer --vocab-size N``)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError


class NullTokenizer(MegatronTokenizer):
    """Ids ``0 .. vocab_size - 1``; the last one is end-of-document (megatron-core's default);
    no BOS or pad. ``tokenize("3 1 4")`` is ``[3, 1, 4]``."""

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or vocab_size < 2:
            raise TokenizerError(f"NullTokenizer needs --vocab-size >= 2, got {vocab_size}")
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(piece) for piece in text.split()]
        except ValueError:
            raise TokenizerError(f"NullTokenizer reads space-separated integer ids, got {text[:40]!r}") from None
        return self._checked(ids)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._checked([int(i) for i in ids])
        if skip_special_tokens:
            ids = [i for i in ids if i != self.eod]
        return " ".join(map(str, ids))

    def _checked(self, ids: list[int]) -> list[int]:
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} are outside 0..{self._vocab_size - 1} (--vocab-size)")
        return ids

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def fingerprint(self) -> str:
        return f"NullTokenizer:{self._vocab_size}"

    @property
    def bos(self) -> None:
        return None

    @property
    def pad(self) -> None:
        return None
