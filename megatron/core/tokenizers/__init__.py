"""Tokenizers: a built-in byte-level one and a HuggingFace tokenizer.json wrapper."""

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from megatron.core.tokenizers.factory import DEFAULT_TOKENIZER_TYPE, TOKENIZER_TYPES, build_tokenizer
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer

__all__ = [
    "ByteLevelTokenizer",
    "DEFAULT_TOKENIZER_TYPE",
    "HuggingFaceTokenizer",
    "MegatronTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "build_tokenizer",
]
