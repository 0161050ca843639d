"""Features that change how work is split never change outputs: chunked prefill, prefix
caching and speculative decoding give exactly the tokens of the plain engine, and each really
ran (prefix hits skip prefill work; drafts are both accepted and rejected)."""

import pytest
import torch

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.engines.common import (
    VOCAB,
    assert_same_outputs,
    gpt_model,
    hybrid_model,
    mtp_model_with_tied_heads,
    prompts,
    reference_greedy,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=True, return_prompt_logprobs=True)
ARGS = dict(block_size=4, num_blocks=128, max_requests=8, max_sequence_length=96)
MODELS = {"gpt": gpt_model, "hybrid": hybrid_model}


@pytest.mark.parametrize("kind", list(MODELS))
@on_single_rank
def test_chunked_prefill_gives_the_unchunked_outputs(pg, kind):
    lengths = [20, 7, 13, 2]
    model = MODELS[kind](pg)
    whole = run(
        DynamicInferenceEngine(model, max_tokens_per_step=32, pg_collection=pg, **ARGS), prompts(lengths), GREEDY
    )
    chunked_engine = DynamicInferenceEngine(
        model, max_tokens_per_step=6, enable_chunked_prefill=True, pg_collection=pg, **ARGS
    )
    steps = []
    build_step = chunked_engine.context.build_step
    chunked_engine.context.build_step = lambda schedule, **kw: (
        steps.append(list(schedule)) or build_step(schedule, **kw)
    )
    chunked = run(chunked_engine, prompts(lengths), GREEDY)
    reference = [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts(lengths)]
    # Different step sizes (6 vs 32 tokens) run different GEMM shapes: tokens are equal, log-probs
    # agree to rounding (exact equality is promised for the same step size, see test_saturation).
    for request_id, want in whole.items():
        assert chunked[request_id]["tokens"] == want["tokens"]
        torch.testing.assert_close(chunked[request_id]["log_probs"], want["log_probs"], rtol=0, atol=1e-5)
        torch.testing.assert_close(chunked[request_id]["prompt_log_probs"], want["prompt_log_probs"], rtol=0, atol=1e-5)
    assert [whole[str(i)]["tokens"] for i in range(len(lengths))] == reference
    # Each prompt longer than a step was split into several chunks, none of them a lone final token.
    for request_id, length in (("0", 20), ("2", 13)):
        sizes = [n for schedule in steps for rid, n in schedule if rid == request_id]
        chunks, total = [], 0
        while total < length:
            chunks.append(sizes[len(chunks)])
            total += chunks[-1]
        assert total == length and len(chunks) > 1 and min(chunks) >= 2, chunks


@pytest.mark.parametrize("kind", list(MODELS))
@on_single_rank
def test_prefix_cache_hits_skip_prefill_and_keep_outputs(pg, kind):
    shared = prompts([16], seed=5)[0]
    followers = [shared + tail for tail in prompts([5, 9, 3], seed=6)]

    def generate(enable_prefix_caching):
        engine = DynamicInferenceEngine(
            MODELS[kind](pg),
            max_tokens_per_step=32,
            enable_prefix_caching=enable_prefix_caching,
            pg_collection=pg,
            **ARGS,
        )
        first = run(engine, [shared], GREEDY)
        rest = {}
        for index, prompt in enumerate(followers):  # ids must be fresh: prefix them
            engine.add_request(f"f{index}", prompt, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                rest.setdefault(out.request_id, []).extend(out.new_token_ids)
        return first, rest, engine.stats

    cached_first, cached_rest, cached_stats = generate(True)
    plain_first, plain_rest, plain_stats = generate(False)
    assert cached_first == plain_first and cached_rest == plain_rest
    assert cached_stats["prefix_cache_hits"] >= 2 * len(followers)
    assert plain_stats["prefix_cache_hits"] == 0
    assert cached_stats["prefill_tokens_computed"] <= plain_stats["prefill_tokens_computed"] - 8 * len(followers)


@on_single_rank
def test_speculative_decoding_accepts_and_rejects_drafts_without_changing_outputs(pg):
    params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=True)] * 3 + [
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=24, logprobs=True)
    ]
    model = mtp_model_with_tied_heads(pg)
    plain = run(
        DynamicInferenceEngine(model, max_tokens_per_step=32, pg_collection=pg, **ARGS), prompts([5, 9, 3, 6]), params
    )
    engine = DynamicInferenceEngine(model, max_tokens_per_step=32, num_speculative_tokens=2, pg_collection=pg, **ARGS)
    speculative = run(engine, prompts([5, 9, 3, 6]), params)
    assert_same_outputs(speculative, plain)
    assert engine.stats["drafts_accepted"] > 0 and engine.stats["drafts_rejected"] > 0
    assert engine.stats["steps"] < max(len(r["tokens"]) for r in plain.values()) + 1
    assert engine.context.private_page_init_counts["lookahead"] > 0
    assert all(0 <= t < VOCAB for r in speculative.values() for t in r["tokens"])


# YaRN RoPE: its frequencies in the rotation, its concentration in the paged attention's scale
YARN = {
    "position_embedding_type": "yarn",
    "yarn_rotary_scaling_factor": 4.0,
    "yarn_original_max_position_embeddings": 8,
}
WITH_YARN = {**MODELS, "gpt_yarn": lambda pg: gpt_model(pg, **YARN, yarn_mscale=3.0)}


@pytest.mark.parametrize("kind", list(WITH_YARN))
@on_single_rank
def test_unpadded_steps_give_the_reference_greedy_tokens(pg, kind):
    lengths = [9, 4, 14]
    model = WITH_YARN[kind](pg)
    engine = DynamicInferenceEngine(
        model, max_tokens_per_step=8, enable_chunked_prefill=True, batch_invariant=False, pg_collection=pg, **ARGS
    )
    sizes = []
    build_step = engine.context.build_step
    engine.context.build_step = lambda schedule, **kw: (
        sizes.append(build_step(schedule, **kw).num_padded_tokens) or engine.context.step
    )
    results = run(engine, prompts(lengths), GREEDY)
    reference = [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts(lengths)]
    assert [results[str(i)]["tokens"] for i in range(len(lengths))] == reference
    assert min(sizes) < 8
