"""The engine owns the output text: LLM.stream's text deltas add up to LLM.generate's text; a
stop sequence spanning token boundaries ends a request exactly once, its text right before the
stop and its tokens through the one that completed the stop (tokens sampled after it in the same
speculative step are not reported), for the byte-level and an HF BPE tokenizer; a long
generation decodes a bounded number of token ids per generated token."""

import asyncio
import contextlib
import dataclasses
import re

import pytest

from megatron.core.inference.engines import DynamicInferenceEngine, StopSequencesNeedTokenizerError
from megatron.core.inference.llm import LLM
from megatron.core.inference.sampling import SamplingParams
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer
from tests.unit_tests.inference.engines.common import CountingTokenizer, gpt_model, mtp_model_with_tied_heads, run
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import EOS, generated_sentences
from tests.unit_tests.transformer.single_rank import on_single_rank

ENGINE = dict(block_size=4, num_blocks=64, max_tokens_per_step=32, max_sequence_length=80)
PROMPT = "the cat sat"
TOKENIZERS = ["bytes", "bpe"]


def ascii_bpe(directory) -> HuggingFaceTokenizer:
    """A byte-level BPE tokenizer.json trained on generated sentences, with an ASCII alphabet: every
    token decodes to whole characters, so a random model's output is clean text to pick stops from."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    ascii_alphabet = [chr(b) for b in range(33, 127)] + ["\u0120"]  # ByteLevel writes a space as U+0120
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=[EOS], initial_alphabet=ascii_alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(generated_sentences(), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return HuggingFaceTokenizer(directory)


def build_tokenizer(name: str, directory) -> tuple:
    """(tokenizer, model vocabulary size): the model only produces ids that decode to ASCII."""
    if name == "bytes":
        return ByteLevelTokenizer(), 128
    tokenizer = ascii_bpe(directory)
    return tokenizer, tokenizer.vocab_size


def stream(llm: LLM, prompt: str, params: SamplingParams) -> list:
    async def deltas():
        async with contextlib.aclosing(llm.stream(prompt, params)) as outputs:
            return [delta async for delta in outputs]

    return asyncio.run(deltas())


@pytest.mark.parametrize("name", TOKENIZERS)
@on_single_rank
def test_stream_text_deltas_add_up_to_the_generated_text(pg, name, tmp_path):
    tokenizer, vocab_size = build_tokenizer(name, tmp_path)
    llm = LLM(gpt_model(pg, vocab_size=vocab_size), tokenizer, pg_collection=pg, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=["never seen"])
    (whole,) = llm.generate([PROMPT], params)
    deltas = stream(llm, PROMPT, params)
    assert len(deltas) > 1 and [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids and len(whole.token_ids) == 32
    assert "".join(d.new_text for d in deltas) == whole.text == tokenizer.detokenize(whole.token_ids)


def stop_completed_by(text: str, ends: list[int], token_index: int) -> str | None:
    """The stop sequence ``text[ends[k - 1] - 1 : ends[k]]`` (the last character before token ``k``
    and that token's text) when it completes exactly at token ``k`` = ``token_index``."""
    start, end = ends[token_index - 1] - 1, ends[token_index]
    stop = text[start:end]
    if len(stop) < 2 or text.find(stop) != start:
        return None
    return stop


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("name", TOKENIZERS)
@on_single_rank
def test_stop_sequence_spanning_tokens_ends_the_request_once_before_the_stop(pg, name, speculative, tmp_path):
    tokenizer, vocab_size = build_tokenizer(name, tmp_path)
    # With speculation, drafts are often right, so a step often ends with several tokens.
    build = mtp_model_with_tied_heads if speculative else gpt_model
    llm = LLM(
        build(pg, vocab_size=vocab_size),
        tokenizer,
        pg_collection=pg,
        num_speculative_tokens=2 if speculative else 0,
        **ENGINE,
    )
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    full = stream(llm, PROMPT, params)
    tokens = [t for d in full for t in d.new_token_ids]
    text = "".join(d.new_text for d in full)
    ends = [len(tokenizer.detokenize(tokens[:k])) for k in range(len(tokens) + 1)]  # text end after k tokens
    # Tokens that share an engine step with a later token (with speculation: drafts accepted).
    mid_step = {
        sum(len(d.new_token_ids) for d in full[:i]) + j
        for i, d in enumerate(full)
        for j in range(1, len(d.new_token_ids))
    }
    candidates = [k for k in range(len(tokens) // 3, len(tokens)) if k in mid_step or not speculative]
    completes_at, stop = next((k, s) for k in candidates if (s := stop_completed_by(text, ends, k)) is not None)

    stopped = dataclasses.replace(params, stop=("never seen", stop))
    deltas = stream(llm, PROMPT, stopped)
    terminal = [d for d in deltas if d.finished]
    assert len(terminal) == 1 and terminal[0].finish_reason == "stop"
    assert "".join(d.new_text for d in deltas) == text[: text.index(stop)]
    assert [t for d in deltas for t in d.new_token_ids] == tokens[:completes_at]
    assert terminal[0].generated_tokens == completes_at
    (whole,) = llm.generate([PROMPT], stopped)
    assert (whole.text, whole.token_ids, whole.finish_reason) == (
        text[: text.index(stop)],
        tokens[:completes_at],
        "stop",
    )
    if speculative:
        assert llm.engine.stats["drafts_accepted"] > 0


@on_single_rank
def test_a_long_generation_decodes_a_bounded_number_of_token_ids_per_token(pg):
    # 1024 tokens: decoding the whole output (or a window growing with it) at every step would
    # decode ~n^2/2 = 524288 ids, 64x the bound of 8 per token.
    length = 1024
    tokenizer = CountingTokenizer(ByteLevelTokenizer())
    model = gpt_model(pg, vocab_size=tokenizer.vocab_size, num_layers=1, max_sequence_length=length + 4)
    engine = DynamicInferenceEngine(
        model,
        tokenizer=tokenizer,
        block_size=256,
        num_blocks=17,
        max_tokens_per_step=4,
        max_sequence_length=length + 4,
        pg_collection=pg,
    )
    params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True, stop=["never seen", "\x00\x01\x02"])
    result = run(engine, [[1, 2, 3]], params)["0"]
    assert len(result["tokens"]) == length and result["finish_reason"] == "length" and result["terminal"] == 1
    assert tokenizer.decoded_ids <= 8 * length


@on_single_rank
def test_stop_sequences_need_an_engine_with_a_tokenizer(pg):
    engine = DynamicInferenceEngine(gpt_model(pg), pg_collection=pg, **ENGINE)
    message = "stop sequences ['x'] need an engine built with a tokenizer; this one has none, send no stop"
    with pytest.raises(StopSequencesNeedTokenizerError, match=re.escape(message)):
        engine.add_request("a", [1, 2], SamplingParams(stop="x"))
    assert not engine.has_unfinished_requests()
