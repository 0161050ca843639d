"""Pieces shared by GPT and hybrid language models (embedding, output layer, loss, MTP glue)."""

from megatron.core.models.common.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module import LanguageModule, mask_vocab_padding

__all__ = ["LanguageModelEmbedding", "LanguageModule", "mask_vocab_padding"]
