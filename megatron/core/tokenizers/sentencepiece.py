"""Megatron's ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` and
``Llama2Tokenizer``: a SentencePiece ``.model`` file (``--tokenizer-model``) through the
``sentencepiece`` library."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError


class SentencePieceTokenizer(MegatronTokenizer):
    """Ids are the model's pieces (``vocab_size`` = its piece count); end-of-document is the
    model's EOS piece, BOS and pad the model's own (None when the model has none), as
    megatron-core's SentencePiece wrapper does."""

    def __init__(self, tokenizer_model: str | Path | None):
        if tokenizer_model is None:
            raise TokenizerError("SentencePieceTokenizer needs --tokenizer-model: a SentencePiece .model file")
        path = Path(tokenizer_model)
        if not path.is_file():
            raise TokenizerError(f"--tokenizer-model {str(path)!r} is not a SentencePiece .model file")
        try:
            import sentencepiece
        except ImportError as exc:
            raise TokenizerError(
                "SentencePieceTokenizer needs the sentencepiece package: pip install -e '.[hf]'"
            ) from exc
        self.model_file = path
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.Load(str(path))
        except Exception as exc:  # sentencepiece raises OSError or RuntimeError on a bad file
            raise TokenizerError(f"{path} is not a valid SentencePiece model: {exc}") from exc
        if self._processor.eos_id() < 0:
            raise TokenizerError(f"{path} has no EOS piece, which the data pipeline uses as end-of-document")

    def _optional(self, token_id: int) -> int | None:
        return token_id if token_id >= 0 else None

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return list(self._processor.encode(text))

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} are outside 0..{self.vocab_size - 1} of {self.model_file}")
        if skip_special_tokens:
            ids = [i for i in ids if not self._processor.is_control(i)]
        return self._processor.decode(ids)

    @property
    def eod(self) -> int:
        return self._processor.eos_id()

    @property
    def bos(self) -> int | None:
        return self._optional(self._processor.bos_id())

    @property
    def pad(self) -> int | None:
        return self._optional(self._processor.pad_id())


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: the SentencePiece model's pieces with its BOS piece in
    front of every tokenized text (each document of a preprocessed dataset starts with it)."""

    def __init__(self, tokenizer_model: str | Path | None):
        super().__init__(tokenizer_model)
        if self.bos is None:
            raise TokenizerError(f"{self.model_file} has no BOS piece, which Llama2Tokenizer puts before every text")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *super().tokenize(text)]
