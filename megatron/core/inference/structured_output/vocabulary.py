"""The tokenizer's vocabulary as the grammar library sees it (``xgrammar.TokenizerInfo``).

Ids are the model's: ``vocab_size`` is the model's (padded) vocabulary, so ids past the
tokenizer's are never allowed. Special tokens (BOS, padding, ...) are never allowed inside the
grammar; the end-of-sequence token is the grammar's stop token.
"""

from __future__ import annotations

from megatron.core.inference.structured_output.errors import GrammarCompileError
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer, MegatronTokenizer
from megatron.core.tokenizers.byte_level import NUM_BYTES


def tokenizer_info(tokenizer: MegatronTokenizer | None, vocab_size: int, eos_token_id: int | None):
    """The ``xgrammar.TokenizerInfo`` of ``tokenizer`` over ``vocab_size`` ids, whose stop token
    is ``eos_token_id`` (the tokenizer's end-of-document token when None).

    Byte-level tokenizers give raw one-byte tokens (a multi-byte character spans several tokens;
    the grammar matches bytes); HuggingFace tokenizers give their vocabulary in its own encoding
    (byte-level BPE, byte fallback, ...), as xgrammar detects it from ``tokenizer.json``.

    Raises:
        GrammarCompileError: without a tokenizer, or for a tokenizer of another kind.
    """
    import xgrammar

    if tokenizer is not None and eos_token_id is None:
        eos_token_id = tokenizer.eod
    if isinstance(tokenizer, ByteLevelTokenizer):
        special = set(tokenizer.special_tokens.values())
        encoded = [b"" if i in special else bytes((i,)) for i in range(NUM_BYTES)]
        encoded += [b""] * (tokenizer.vocab_size - NUM_BYTES)
        return xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos_token_id]
        )
    if isinstance(tokenizer, HuggingFaceTokenizer):
        return _huggingface_info(tokenizer, vocab_size, eos_token_id)
    kind = "no tokenizer" if tokenizer is None else f"a {type(tokenizer).__name__}"
    raise GrammarCompileError(
        grammar="a grammar",
        reason=f"the engine has {kind}; structured output needs a byte-level or HuggingFace tokenizer",
    )


def _huggingface_info(tokenizer: HuggingFaceTokenizer, vocab_size: int, eos_token_id: int):
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend
    detected = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=backend), vocab_size=vocab_size, stop_token_ids=[eos_token_id]
    )
    # transformers does not know which added tokens are special here; tokenizer.json does.
    special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    encoded = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = token
    return xgrammar.TokenizerInfo.from_vocab_and_metadata(encoded, detected.dump_metadata())
