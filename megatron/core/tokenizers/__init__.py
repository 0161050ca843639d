"""Tokenizers: byte-level, HuggingFace tokenizer.json, GPT-2 BPE files, SentencePiece, null."""

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from megatron.core.tokenizers.factory import (
    DEFAULT_TOKENIZER_TYPE,
    TOKENIZER_TYPES,
    build_tokenizer,
    check_tokenizer_inputs,
)
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece import SentencePieceTokenizer

__all__ = [
    "ByteLevelTokenizer",
    "DEFAULT_TOKENIZER_TYPE",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "MegatronTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "build_tokenizer",
    "check_tokenizer_inputs",
]
