"""Incremental detokenization and stop sequences (TextStream): the deltas concatenate to the
decode of the whole output, characters split across tokens are held back, stop sequences that
span tokens stop exactly once at the token that completes them, and the ids decoded per token
are bounded (no re-decoding of the whole output)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.core.inference.text_stream import IncrementalDetokenizer, TextStream
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer
from tests.unit_tests.inference.engines.common import CountingTokenizer
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import train_tiny_tokenizer

BYTES = ByteLevelTokenizer()
MULTILINGUAL = "the cat sat on a mat. é€😀 日本語のテキスト — “quoted” ünïcödé 🙂🙃 tree house."


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return HuggingFaceTokenizer(train_tiny_tokenizer(tmp_path_factory.mktemp("bpe")))


def streamed(tokenizer, ids) -> tuple[list[str], int]:
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting)
    deltas = [detokenizer.add(t) for t in ids]
    return deltas + [detokenizer.flush()], counting.decoded_ids


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.sampled_from([0x61, 0x20, 0x80, 0x82, 0x98, 0x9F, 0xA9, 0xAC, 0xC3, 0xE2, 0xF0, 0xFF]), max_size=40)
)
def test_any_byte_stream_streams_to_its_whole_decode_in_bounded_work(ids):
    # Valid and invalid UTF-8 alike: split characters, lone continuation bytes, truncated sequences.
    deltas, decoded = streamed(BYTES, ids)
    assert "".join(deltas) == BYTES.detokenize(ids)
    assert decoded <= 6 * len(ids) + 4


def test_a_character_split_across_tokens_is_held_back_until_complete():
    deltas, _ = streamed(BYTES, list("a€b".encode()))
    assert deltas == ["a", "", "", "€", "b", ""]


def test_invalid_utf8_forever_is_still_linear_work():
    deltas, decoded = streamed(BYTES, [0xE2, 0x82] * 2048)
    assert "".join(deltas) == "\ufffd" * 2048 and decoded <= 6 * 4096


def test_bpe_tokens_of_multilingual_text_and_random_ids_stream_exactly(bpe):
    for ids in (bpe.tokenize(MULTILINGUAL * 3), [(7 * i * i + 3 * i) % bpe.vocab_size for i in range(300)]):
        deltas, decoded = streamed(bpe, ids)
        assert "".join(deltas) == bpe.detokenize(ids)
        assert decoded <= 6 * len(ids)


def text_until_stop(tokenizer, ids, stop):
    """(text, tokens kept, stopped) of TextStream over ``ids`` with finish rules as the engine's."""
    stream, takes = TextStream(tokenizer, stop), []
    for count, token in enumerate(ids, start=1):
        stopped = stream.add_token(token)
        takes.append(stream.take())
        if stopped:
            return "".join(takes), count, True
    stopped = stream.finish()
    return "".join(takes) + stream.take(), len(ids), stopped


@pytest.mark.parametrize("tokenizer_name", ["bytes", "bpe"])
def test_stop_sequences_spanning_tokens_stop_once_right_before_the_stop(tokenizer_name, bpe):
    tokenizer = BYTES if tokenizer_name == "bytes" else bpe
    ids = tokenizer.tokenize(MULTILINGUAL)
    full = tokenizer.detokenize(ids)
    for stop in ("€😀 日", "mat. é", "ünïc", "tree house."):
        # The stop ends inside the token that completes it; independent expectation by prefixes.
        completes_at = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.detokenize(ids[:k]))
        assert text_until_stop(tokenizer, ids, (stop, "never")) == (full[: full.index(stop)], completes_at, True)
    assert text_until_stop(tokenizer, ids, ("never",)) == (full, len(ids), False)


def test_a_possible_stop_start_is_held_back_and_released_at_the_end():
    stream = TextStream(BYTES, ("xyz",))
    assert [stream.add_token(t) or stream.take() for t in b"abx"] == ["a", "b", ""]
    assert stream.finish() is False and stream.take() == "x"
