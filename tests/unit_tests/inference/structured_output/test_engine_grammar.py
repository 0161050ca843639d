"""Grammar-constrained decoding in the engine: speculative drafts checked against the grammar,
a matcher rebuilt from tokens (the handoff path) continuing where the original stood, pauses,
evictions and overlapped steps leaving outputs unchanged, a grammar that does not compile refused
alone, and a byte-level BPE vocabulary."""

import json

import jsonschema
import pytest
import torch
import xgrammar

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.structured_output import GrammarCompileError, StructuredOutputParams
from megatron.core.inference.structured_output.compiler import GrammarCache
from megatron.core.inference.structured_output.matcher import RequestMatcher
from megatron.core.inference.structured_output.params import schema_text
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer
from tests.unit_tests.inference.engines.common import assert_same_outputs, gpt_model, mtp_model_with_tied_heads, run
from tests.unit_tests.inference.handoff.common import build_engine, build_model, nixl, run_handoff
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import train_tiny_tokenizer
from tests.unit_tests.transformer.single_rank import on_single_rank

BYTES = ByteLevelTokenizer()
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -99, "maximum": 99},
        "label": {"enum": ["a", "bb", "ccc"]},
        "ok": {"type": "boolean"},
    },
    "required": ["x", "label", "ok"],
}
# A free-text field, where the grammar-blind MTP drafts are sometimes right.
NOTE = {"type": "object", "properties": {"note": {"type": "string", "pattern": "^[a-z ]{0,40}$"}}, "required": ["note"]}
GRAMMAR = StructuredOutputParams(json_schema=schema_text(POINT))
ARGS = dict(block_size=4, num_blocks=128, max_requests=8, max_sequence_length=96)


def _prompts() -> list[list[int]]:
    return [BYTES.tokenize(text) for text in ("point", "a point", "p", "where?")]


def _params(**overrides) -> list[SamplingParams]:
    base = dict(max_tokens=60, logprobs=True, structured_output=GRAMMAR) | overrides
    return [SamplingParams(temperature=0.0, **base)] * 2 + [
        SamplingParams(temperature=1.0, seed=seed, **base) for seed in (3, 4)
    ]


def _assert_valid(results: dict, tokenizer=BYTES, schema=POINT) -> None:
    for result in results.values():
        assert result["finish_reason"] == "stop"
        jsonschema.validate(json.loads(tokenizer.detokenize(result["tokens"])), schema)


@on_single_rank
def test_speculative_drafts_are_checked_against_the_grammar_and_outputs_equal_the_plain_engines(pg):
    model = mtp_model_with_tied_heads(pg, vocab_size=BYTES.vocab_size)
    params = _params(structured_output=StructuredOutputParams(json_schema=schema_text(NOTE)))
    plain = run(
        DynamicInferenceEngine(model, max_tokens_per_step=32, tokenizer=BYTES, pg_collection=pg, **ARGS),
        _prompts(),
        params,
    )
    engine = DynamicInferenceEngine(
        model, max_tokens_per_step=32, num_speculative_tokens=2, tokenizer=BYTES, pg_collection=pg, **ARGS
    )
    speculative = run(engine, _prompts(), params)
    assert_same_outputs(speculative, plain)
    _assert_valid(plain, schema=NOTE)
    # The MTP heads know nothing of the grammar: some drafts break it and are rejected, others pass.
    assert engine.stats["drafts_accepted"] > 0 and engine.stats["drafts_rejected"] > 0


def test_draft_rows_follow_the_drafts_up_to_the_first_invalid_one_and_the_matcher_is_rolled_back():
    grammars = GrammarCache(BYTES, BYTES.vocab_size, BYTES.eod)
    compiled = grammars.compile(GRAMMAR)
    matcher = RequestMatcher(compiled)
    matcher.sync(BYTES.tokenize('{"x": '))
    masks = torch.zeros(4, 9, dtype=torch.int32)
    valid, invalid = BYTES.tokenize("1")[0], BYTES.tokenize("z")[0]
    matcher.fill(masks, 0, 4, [valid, invalid, valid])

    def allowed(row):
        logits = torch.zeros(1, BYTES.vocab_size)
        xgrammar.apply_token_bitmask_inplace(logits, masks[row : row + 1].clone())
        return set(torch.nonzero(logits[0] == 0).flatten().tolist())

    assert allowed(0) == set(BYTES.tokenize("-0123456789"))  # a number starts
    assert allowed(1) == set(BYTES.tokenize("0123456789,"))  # after '1' (at most 99)
    assert allowed(2) == allowed(1) and allowed(3) == allowed(1)  # past 'z': repeated, never sampled
    again = torch.zeros(1, 9, dtype=torch.int32)
    matcher.fill(again, 0, 1, [])
    assert torch.equal(again[0], masks[0])  # the drafts were rolled back


@on_single_rank
def test_handoff_rebuilds_the_matcher_from_tokens_and_equals_one_engine(pg):
    def engine(**overrides):
        return build_engine(
            build_model("gpt", pg, vocab_size=BYTES.vocab_size),
            pg,
            tokenizer=BYTES,
            num_blocks=96,
            max_sequence_length=96,
            **overrides,
        )

    params = _params(max_tokens=40, logprobs=False)
    reference = run(engine(), _prompts(), params)
    prefill = PrefillSide(engine(prefix_caching=False), nixl("prefill"))
    got = run_handoff(prefill, DecodeSide(engine(), nixl("decode")), _prompts(), params)
    assert {rid: r["tokens"] for rid, r in got.items()} == {rid: r["tokens"] for rid, r in reference.items()}
    _assert_valid(reference)


@on_single_rank
def test_a_grammar_that_does_not_compile_is_refused_alone(pg):
    engine = DynamicInferenceEngine(
        gpt_model(pg, vocab_size=BYTES.vocab_size), max_tokens_per_step=32, tokenizer=BYTES, pg_collection=pg, **ARGS
    )
    bad = StructuredOutputParams(json_schema='{"type": "object", "properties": {"a": {"type": "quaternion"}}}')
    with pytest.raises(GrammarCompileError) as error:
        engine.add_request("bad", BYTES.tokenize("p"), SamplingParams(structured_output=bad))
    assert str(error.value) == 'cannot constrain the output to the JSON schema: Unsupported type "quaternion"'
    assert GrammarCompileError.from_dict(error.value.to_dict()) == error.value
    _assert_valid(run(engine, _prompts(), _params()))


@on_single_rank
def test_a_byte_level_bpe_vocabulary_is_constrained_without_its_special_tokens(pg, tmp_path):
    tokenizer = HuggingFaceTokenizer(train_tiny_tokenizer(tmp_path))
    model = gpt_model(pg, vocab_size=384)  # padded past the tokenizer's 320 ids
    engine = DynamicInferenceEngine(model, max_tokens_per_step=32, tokenizer=tokenizer, pg_collection=pg, **ARGS)
    prompts = [tokenizer.tokenize(text) for text in ("the cat", "a dog ran", "red", "blue tree")]
    results = run(engine, prompts, _params())
    _assert_valid(results, tokenizer)
    special = {tokenizer.bos, tokenizer.pad}
    assert all(not special & set(r["tokens"]) and max(r["tokens"]) < 320 for r in results.values())


@on_single_rank
def test_pauses_evictions_and_overlapped_steps_keep_each_requests_grammar_state(pg):
    model = gpt_model(pg, vocab_size=BYTES.vocab_size)
    params = _params(max_tokens=64, structured_output=StructuredOutputParams(json_schema=schema_text(NOTE)))

    def generate(num_blocks, paused_block_budget, **modes):
        engine = DynamicInferenceEngine(
            model,
            block_size=8,
            max_tokens_per_step=16,
            max_sequence_length=80,
            max_requests=8,
            enable_chunked_prefill=True,
            num_blocks=num_blocks,
            paused_block_budget=paused_block_budget,
            tokenizer=BYTES,
            pg_collection=pg,
            **modes,
        )
        return run(engine, _prompts(), params), engine.stats

    roomy, _ = generate(100, 100)
    tight, stats = generate(10, 3)
    # Overlapped: the masks of step N+1 are filled after N's tokens are applied, while N+1's forward runs.
    overlapped, overlapped_stats = generate(10, 3, overlap_steps=True)
    assert stats["pauses"] > 0 and stats["evictions"] > 0 and overlapped_stats["evictions"] > 0
    assert_same_outputs(tight, roomy)
    assert_same_outputs(overlapped, roomy)
    _assert_valid(roomy, schema=NOTE)
