"""Byte-level and HuggingFace tokenizers: exact round trips, special ids, and clear errors."""

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron.core.tokenizers import (
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    TokenizerError,
    build_tokenizer,
)
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import (
    BOS,
    EOS,
    PAD,
    generated_sentences,
    train_tiny_tokenizer,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_tok")
    train_tiny_tokenizer(directory)
    return directory


# ---- byte level ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_level_round_trips_any_unicode(text):
    tokenizer = ByteLevelTokenizer()
    ids = tokenizer.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.detokenize(ids) == text


def test_byte_level_vocabulary_and_special_ids():
    tokenizer = build_tokenizer()
    assert isinstance(tokenizer, ByteLevelTokenizer)
    assert tokenizer.vocab_size == 259
    assert (tokenizer.bos, tokenizer.eod, tokenizer.eos, tokenizer.pad) == (256, 257, 257, 258)
    assert tokenizer.tokenize("é!") == [0xC3, 0xA9, 0x21]


def test_byte_level_special_tokens_are_skipped_or_named():
    tokenizer = ByteLevelTokenizer()
    ids = [tokenizer.bos] + tokenizer.tokenize("hi") + [tokenizer.eod, tokenizer.pad]
    assert tokenizer.detokenize(ids) == "hi"
    assert tokenizer.detokenize(ids, skip_special_tokens=False) == "<bos>hi<eos><pad>"


def test_byte_level_invalid_utf8_decodes_with_replacement_character():
    tokenizer = ByteLevelTokenizer()
    cut = tokenizer.tokenize("漢")[:2]  # a 3-byte character cut short
    assert tokenizer.detokenize(tokenizer.tokenize("a") + cut) == "a\ufffd"


def test_byte_level_rejects_out_of_range_id():
    with pytest.raises(TokenizerError, match=r"token id 259 is outside .* accepted ids are 0\.\.258"):
        ByteLevelTokenizer().detokenize([1, 259])


# ---- HuggingFace tokenizer.json -------------------------------------------------------------


def test_hf_round_trips_training_text_and_unicode(hf_dir):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    for text in generated_sentences(count=20, seed=7) + ["naïve 漢字 🙂 tabs\tand\nnewlines"]:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_hf_byte_level_bpe_round_trips_any_unicode(hf_dir, text):
    # Text spelling a special token is encoded as that token (HuggingFace behaviour).
    assume(not any(special in text for special in (EOS, BOS, PAD)))
    tokenizer = HuggingFaceTokenizer(hf_dir / "tokenizer.json")
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_hf_merges_frequent_words_and_finds_special_ids(hf_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tokenizer = HuggingFaceTokenizer(hf_dir)
    assert tokenizer.vocab_size == 320
    assert tokenizer.tokenize("the cat") == [raw.token_to_id("the"), raw.token_to_id("Ġcat")]
    assert (tokenizer.eod, tokenizer.bos, tokenizer.pad) == (0, 1, 2)  # trainer order EOS, BOS, PAD
    ids = [tokenizer.bos] + tokenizer.tokenize("the cat") + [tokenizer.eod]
    assert tokenizer.detokenize(ids) == "the cat"
    assert tokenizer.detokenize(ids, skip_special_tokens=False) == f"{BOS}the cat{EOS}"


def test_hf_special_tokens_come_from_tokenizer_config(tmp_path):
    train_tiny_tokenizer(tmp_path, config={"eos_token": {"content": PAD}, "bos_token": EOS})
    tokenizer = HuggingFaceTokenizer(tmp_path)
    assert (tokenizer.eod, tokenizer.bos) == (2, 0)


def test_hf_config_naming_unknown_token_fails(tmp_path):
    train_tiny_tokenizer(tmp_path, config={"eos_token": "</nope>"})
    with pytest.raises(TokenizerError, match=r"sets eos_token='</nope>', which is not in the vocabulary"):
        HuggingFaceTokenizer(tmp_path)


def test_hf_without_any_end_token_fails(tmp_path):
    train_tiny_tokenizer(tmp_path, special_tokens=("<unk>",))
    with pytest.raises(TokenizerError, match=r"no end-of-document token: set eos_token .* <\|endoftext\|>, </s>"):
        HuggingFaceTokenizer(tmp_path)


def test_hf_rejects_out_of_range_id(hf_dir):
    with pytest.raises(TokenizerError, match=r"\[320\] are outside the vocabulary .* accepted ids are 0\.\.319"):
        HuggingFaceTokenizer(hf_dir).detokenize([3, 320])


def test_hf_chat_template_renders_messages(tmp_path):
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    train_tiny_tokenizer(tmp_path, config={"eos_token": EOS, "chat_template": template})
    tokenizer = HuggingFaceTokenizer(tmp_path)
    messages = [{"role": "user", "content": "the cat"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == f"<|user|>the cat{EOS}<|assistant|>"
    assert tokenizer.apply_chat_template(messages, tokenize=True) == tokenizer.tokenize(f"<|user|>the cat{EOS}")


def test_hf_without_chat_template_says_so(hf_dir):
    with pytest.raises(TokenizerError, match=r"has no chat_template"):
        HuggingFaceTokenizer(hf_dir).apply_chat_template([{"role": "user", "content": "x"}])


# ---- factory errors ---------------------------------------------------------------------------


def test_unknown_tokenizer_type_lists_accepted_types():
    with pytest.raises(
        TokenizerError,
        match=r"unknown tokenizer type 'TikTokenizer'; accepted --tokenizer-type values: "
        r"ByteLevelTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, "
        r"GPTSentencePieceTokenizer, Llama2Tokenizer, NullTokenizer",
    ):
        build_tokenizer("TikTokenizer")


def test_hf_tokenizer_needs_a_model_path():
    with pytest.raises(TokenizerError, match=r"HuggingFaceTokenizer needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")


def test_missing_tokenizer_file_names_what_is_expected(tmp_path):
    with pytest.raises(TokenizerError, match=r"not found: expected a tokenizer.json file or a directory containing"):
        build_tokenizer("HuggingFaceTokenizer", tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match=r"not found"):
        build_tokenizer("HuggingFaceTokenizer", tmp_path)  # a directory without tokenizer.json


def test_malformed_tokenizer_json_fails_clearly(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(TokenizerError, match=r"is not a valid HuggingFace tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tmp_path)


def test_byte_level_rejects_a_model_path():
    with pytest.raises(TokenizerError, match=r"ByteLevelTokenizer takes no --tokenizer-model"):
        build_tokenizer("ByteLevelTokenizer", "tok.json")
