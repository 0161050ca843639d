"""Megatron's tokenizer types: GPT2BPETokenizer from vocab.json + merges.txt (against
transformers' GPT-2 tokenizer read from the same files), SentencePiece models (against the sentencepiece
processor), NullTokenizer; what each reads and refuses."""

import pytest

from megatron.core.tokenizers import (
    GPT2BPETokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    build_tokenizer,
)
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import (
    EOS,
    generated_sentences,
    train_tiny_gpt2_files,
    train_tiny_sentencepiece,
)

TEXTS = ["the cat sat on a mat.", "  red  blue\ttree\nhouse river", "é 漢字 🙂 token model"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return train_tiny_gpt2_files(tmp_path_factory.mktemp("gpt2"))


def test_gpt2_bpe_matches_transformers_gpt2_tokenizer(gpt2_files):
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    reference = GPT2Tokenizer.from_pretrained(str(vocab.parent))  # reads vocab.json + merges.txt
    assert isinstance(ours, GPT2BPETokenizer)
    assert ours.vocab_size == len(reference.get_vocab()) > 256
    assert ours.eod == reference.convert_tokens_to_ids(EOS) and ours.bos is None and ours.pad is None
    for text in TEXTS + generated_sentences(count=20, seed=3):
        ids = ours.tokenize(text)
        assert ids == reference.encode(text)
        assert ours.detokenize(ids) == text
    assert ours.detokenize([*ours.tokenize("the cat"), ours.eod]) == "the cat"
    assert ours.detokenize([*ours.tokenize("the cat"), ours.eod], skip_special_tokens=False) == f"the cat{EOS}"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({}, "GPT2BPETokenizer needs --vocab-file"),
        ({"vocab_file": "missing.json", "merge_file": "m.txt"}, "--vocab-file 'missing.json' is not a file"),
        ({"tokenizer_model": "x"}, r"--tokenizer-type GPT2BPETokenizer does not read --tokenizer-model"),
    ],
)
def test_gpt2_bpe_needs_both_files(kwargs, message):
    with pytest.raises(TokenizerError, match=message):
        build_tokenizer("GPT2BPETokenizer", **kwargs)


def test_gpt2_bpe_without_end_of_text_is_refused(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    broken = tmp_path / "vocab.json"
    broken.write_text(vocab.read_text().replace(EOS, "<|other|>"))
    with pytest.raises(TokenizerError, match="has no '<|endoftext|>' entry"):
        GPT2BPETokenizer(broken, merges)


@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
def test_sentencepiece_matches_the_processor(tokenizer_type, tmp_path):
    import sentencepiece

    model = train_tiny_sentencepiece(tmp_path)
    ours = build_tokenizer(tokenizer_type, model)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert isinstance(ours, SentencePieceTokenizer)
    assert ours.vocab_size == processor.get_piece_size() == 64
    assert (ours.eod, ours.bos, ours.pad) == (processor.eos_id(), processor.bos_id(), None)
    for text in generated_sentences(count=20, seed=4):
        assert ours.tokenize(text) == processor.encode(text)
        assert ours.detokenize(ours.tokenize(text)) == processor.decode(processor.encode(text))
    assert ours.detokenize([ours.bos, *ours.tokenize("the cat"), ours.eod]) == "the cat"


def test_llama2_tokenizer_puts_bos_before_every_text(tmp_path):
    import sentencepiece

    model = train_tiny_sentencepiece(tmp_path)
    ours = build_tokenizer("Llama2Tokenizer", model)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    for text in generated_sentences(count=5, seed=6):
        assert ours.tokenize(text) == [processor.bos_id(), *processor.encode(text)]
        assert ours.detokenize(ours.tokenize(text)) == processor.decode(processor.encode(text))
    assert (ours.eod, ours.vocab_size) == (processor.eos_id(), 64)


def test_sentencepiece_needs_a_model_file(tmp_path):
    with pytest.raises(TokenizerError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="is not a valid SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tmp_path / "bad.model")


def test_null_tokenizer_reads_ids_and_ends_documents_with_the_last_id():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.bos, tokenizer.pad) == (100, 99, None, None)
    assert tokenizer.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tokenizer.detokenize([3, 1, 99]) == "3 1"
    with pytest.raises(TokenizerError, match="outside 0..99"):
        tokenizer.tokenize("100")
    with pytest.raises(TokenizerError, match="NullTokenizer needs --vocab-size >= 2, got None"):
        build_tokenizer("NullTokenizer")
