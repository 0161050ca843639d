"""Megatron's ``GPT2BPETokenizer``: GPT-2's byte-level BPE from a ``vocab.json`` and a
``merges.txt`` (``--vocab-file`` / ``--merge-file``), run by the ``tokenizers`` library."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError

END_OF_TEXT = "<|endoftext|>"


def _existing_file(path: str | Path | None, flag: str) -> Path:
    if path is None:
        raise TokenizerError(f"GPT2BPETokenizer needs {flag} (GPT-2's vocab.json and merges.txt)")
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"{flag} {str(path)!r} is not a file")
    return path


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE: ``vocab.json`` maps tokens to ids, ``merges.txt`` lists the merges
    in rank order. The end-of-document id is ``<|endoftext|>``'s; there is no BOS or pad token.
    ``vocab_size`` is the number of entries of ``vocab.json``, as in Megatron."""

    def __init__(self, vocab_file: str | Path, merge_file: str | Path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.vocab_file = _existing_file(vocab_file, "--vocab-file")
        self.merge_file = _existing_file(merge_file, "--merge-file")
        try:
            vocab = json.loads(self.vocab_file.read_text(encoding="utf-8"))
            model = models.BPE.from_file(str(self.vocab_file), str(self.merge_file))
        except Exception as exc:  # json and the tokenizers library raise plain exceptions on bad files
            raise TokenizerError(
                f"{self.vocab_file} / {self.merge_file} are not a GPT-2 vocab.json / merges.txt pair: {exc}"
            ) from exc
        if END_OF_TEXT not in vocab:
            raise TokenizerError(f"{self.vocab_file} has no {END_OF_TEXT!r} entry, GPT-2's end-of-document token")
        self._tokenizer = Tokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        self._vocab_size = len(vocab)
        self._eod = vocab[END_OF_TEXT]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} are outside 0..{self._vocab_size - 1} of {self.vocab_file}")
        if skip_special_tokens:
            ids = [i for i in ids if i != self._eod]
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> None:
        return None

    @property
    def pad(self) -> None:
        return None
