"""build_tokenizer: the one place that maps a --tokenizer-type name to a tokenizer."""

from __future__ import annotations

from pathlib import Path

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece import Llama2Tokenizer, SentencePieceTokenizer

DEFAULT_TOKENIZER_TYPE = "ByteLevelTokenizer"
# Megatron's SentencePiece names: GPTSentencePieceTokenizer is the one its GPT/Mamba examples use.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
TOKENIZER_TYPES = (
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    *SENTENCEPIECE_TYPES,
    "Llama2Tokenizer",
    "NullTokenizer",
)
# What each type reads; anything else given is an error (a flag that would be silently ignored).
_INPUTS = {
    "ByteLevelTokenizer": (),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
_FLAGS = {
    "tokenizer_model": "--tokenizer-model",
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
    "vocab_size": "--vocab-size",
}


def tokenizer_inputs(tokenizer_type: str) -> tuple[str, ...]:
    """The inputs ``tokenizer_type`` reads (names of :func:`build_tokenizer` arguments); () for an
    unknown type."""
    return _INPUTS.get(tokenizer_type, ())


def check_tokenizer_inputs(tokenizer_type: str, **inputs) -> None:
    """Raise TokenizerError when ``tokenizer_type`` is unknown, or when an input it does not read
    is given (``inputs``: tokenizer_model, vocab_file, merge_file; None means not given).
    ``--vocab-size`` is not checked here: with other types it sizes the embedding."""
    if tokenizer_type not in _INPUTS:
        raise TokenizerError(
            f"unknown tokenizer type {tokenizer_type!r}; accepted --tokenizer-type values: {', '.join(TOKENIZER_TYPES)}"
        )
    unread = [
        _FLAGS[name] for name, value in inputs.items() if value is not None and name not in _INPUTS[tokenizer_type]
    ]
    if unread:
        reads = ", ".join(_FLAGS[name] for name in _INPUTS[tokenizer_type]) or "no files"
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} does not read {', '.join(unread)} (it reads {reads})")


def build_tokenizer(
    tokenizer_type: str = DEFAULT_TOKENIZER_TYPE,
    tokenizer_model: str | Path | None = None,
    *,
    vocab_file: str | Path | None = None,
    merge_file: str | Path | None = None,
    vocab_size: int | None = None,
) -> MegatronTokenizer:
    """Build the tokenizer named by ``tokenizer_type`` (``--tokenizer-type``).

    ``ByteLevelTokenizer`` needs no files; ``HuggingFaceTokenizer`` reads ``tokenizer_model``
    (a tokenizer.json or a directory holding one); ``GPT2BPETokenizer`` reads ``vocab_file`` and
    ``merge_file``; ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` read
    ``tokenizer_model`` (a .model file), as does ``Llama2Tokenizer`` (which puts the BOS piece
    before every text); ``NullTokenizer`` takes ``vocab_size``.
    """
    if tokenizer_type == "ByteLevelTokenizer" and tokenizer_model is not None:
        raise TokenizerError(
            f"ByteLevelTokenizer takes no --tokenizer-model (got {str(tokenizer_model)!r}); "
            "use --tokenizer-type HuggingFaceTokenizer to load a tokenizer.json"
        )
    check_tokenizer_inputs(
        tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=vocab_file, merge_file=merge_file
    )
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    return NullTokenizer(vocab_size)
