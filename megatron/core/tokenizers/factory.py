"""build_tokenizer: the one place that maps a --tokenizer-type name to a tokenizer."""

from __future__ import annotations

from pathlib import Path

from megatron.core.tokenizers.base import MegatronTokenizer, TokenizerError
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer

DEFAULT_TOKENIZER_TYPE = "ByteLevelTokenizer"
TOKENIZER_TYPES = ("ByteLevelTokenizer", "HuggingFaceTokenizer")


def build_tokenizer(
    tokenizer_type: str = DEFAULT_TOKENIZER_TYPE, tokenizer_model: str | Path | None = None
) -> MegatronTokenizer:
    """Build the tokenizer named by ``tokenizer_type`` (``--tokenizer-type``).

    ``ByteLevelTokenizer`` needs no files and takes no model; ``HuggingFaceTokenizer`` needs
    ``tokenizer_model`` (``--tokenizer-model``): a tokenizer.json or a directory holding one.
    """
    if tokenizer_type == "ByteLevelTokenizer":
        if tokenizer_model is not None:
            raise TokenizerError(
                f"ByteLevelTokenizer takes no --tokenizer-model (got {str(tokenizer_model)!r}); "
                "use --tokenizer-type HuggingFaceTokenizer to load a tokenizer.json"
            )
        return ByteLevelTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    raise TokenizerError(
        f"unknown tokenizer type {tokenizer_type!r}; accepted --tokenizer-type values: {', '.join(TOKENIZER_TYPES)}"
    )
