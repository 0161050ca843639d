"""A tokenizer that needs no files: one id per UTF-8 byte, then a few special tokens."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError

NUM_BYTES = 256
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")


class ByteLevelTokenizer(MegatronTokenizer):
    """Ids 0-255 are the bytes of the UTF-8 encoding; 256 ``<bos>``, 257 ``<eos>``, 258 ``<pad>``.

    Every string round-trips exactly. Decoding a byte sequence that is not valid UTF-8
    (e.g. a generation cut inside a multi-byte character) yields U+FFFD for the bad bytes.
    """

    def __init__(self):
        self._special_ids = {name: NUM_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES + len(SPECIAL_TOKENS)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces: list[bytes] = []
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < NUM_BYTES:
                pieces.append(bytes((token_id,)))
            elif NUM_BYTES <= token_id < self.vocab_size:
                if not skip_special_tokens:
                    pieces.append(SPECIAL_TOKENS[token_id - NUM_BYTES].encode("utf-8"))
            else:
                raise TokenizerError(
                    f"token id {token_id} is outside the byte-level vocabulary; "
                    f"accepted ids are 0..{self.vocab_size - 1}"
                )
        return b"".join(pieces).decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return self._special_ids["<eos>"]

    @property
    def bos(self) -> int:
        return self._special_ids["<bos>"]

    @property
    def pad(self) -> int:
        return self._special_ids["<pad>"]

    @property
    def special_tokens(self) -> dict[str, int]:
        """Name -> id of the special tokens."""
        return dict(self._special_ids)
