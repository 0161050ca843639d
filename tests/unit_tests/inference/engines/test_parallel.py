"""The engine under TP2 and PP2 (real gloo ranks) gives the outputs of one process, with
pauses, evictions and speculative decoding (MTP heads on the last stage) in lockstep; every rank
derives the same text and stop-sequence finishes from the shared tokens, and no step pickles."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from megatron.core.tokenizers import ByteLevelTokenizer
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.inference.engines.common import gpt_model, hybrid_model, prompts, run
from tests.unit_tests.models.hybrid.common import collection

PARAMS = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=True, return_prompt_logprobs=True)] * 3 + [
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, logprobs=True)
]
LENGTHS = [6, 13, 3, 9]


def _generate(kind: str, tp: int, pp: int):
    pg = collection(tp=tp, pp=pp)
    speculative = kind == "gpt_speculative"
    if kind.startswith("gpt"):
        model = gpt_model(pg, tp=tp, pp=pp, mtp_depths=2 if speculative else 0)
    else:
        model = hybrid_model(
            pg, pattern="M*|-M" if pp > 1 else "M*-M", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    # A tight pool, so pauses and evictions run in lockstep on every rank too. Steps one by one on
    # every layout (PP cannot overlap them; on a GPU one process would by default, and then it
    # schedules, pauses and counts steps differently).
    engine = DynamicInferenceEngine(
        model,
        block_size=4,
        num_blocks=12,
        max_requests=4,
        max_tokens_per_step=8,
        max_sequence_length=48,
        enable_chunked_prefill=True,
        paused_block_budget=2,
        num_speculative_tokens=2 if speculative else 0,
        overlap_steps=False,
        pg_collection=pg,
    )
    results = run(engine, prompts(LENGTHS), PARAMS)
    return results, engine.stats


def _single_and_parallel(kind: str, tp: int, pp: int):
    # On 2 ranks, TP1/PP1 is two data-parallel replicas: each one a single-process run.
    return _generate(kind, 1, 1), _generate(kind, tp, pp)


@pytest.mark.parametrize(
    "kind,tp,pp",
    [
        ("gpt", 2, 1),
        ("gpt", 1, 2),
        ("hybrid", 2, 1),
        ("hybrid", 1, 2),
        ("gpt_speculative", 2, 1),
        ("gpt_speculative", 1, 2),
    ],
)
def test_tensor_and_pipeline_parallel_engines_match_one_process(kind, tp, pp):
    outcomes = run_distributed(_single_and_parallel, 2, kind, tp, pp)
    (single, single_stats), ranks = outcomes[0][0], [parallel for _, parallel in outcomes]
    assert single_stats["evictions"] > 0 or single_stats["pauses"] > 0
    if kind == "gpt_speculative":
        assert single_stats["drafts_accepted"] + single_stats["drafts_rejected"] > 0
    for results, stats in ranks:
        for key in ("steps", "evictions", "pauses", "drafts_accepted", "drafts_rejected"):
            assert stats[key] == single_stats[key], key
        for request_id, want in single.items():
            got = results[request_id]
            assert got["tokens"] == want["tokens"] and got["terminal"] == 1
            torch.testing.assert_close(got["log_probs"], want["log_probs"], rtol=0, atol=1e-4)
            if want["prompt_log_probs"] is not None:
                torch.testing.assert_close(got["prompt_log_probs"], want["prompt_log_probs"], rtol=0, atol=1e-4)


def _text_outputs(tp: int, pp: int) -> dict:
    """Outputs (with text) of a speculative GPT under ``tp`` x ``pp``, with stop sequences picked
    from a first run's text, and with ``broadcast_object_list`` failing during the second run."""
    pg = collection(tp=tp, pp=pp)
    model = gpt_model(pg, tp=tp, pp=pp, mtp_depths=2, vocab_size=128)  # ids < 128 decode to ASCII
    engine_args = dict(
        tokenizer=ByteLevelTokenizer(),
        block_size=4,
        num_blocks=32,
        max_tokens_per_step=16,
        max_sequence_length=48,
        num_speculative_tokens=2,
        pg_collection=pg,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
    first = run(DynamicInferenceEngine(model, **engine_args), prompts(LENGTHS), plain)
    stops = [first[str(i)]["text"][k : k + 3] for i, k in enumerate((0, 2, 4, 6))]
    params = [dataclasses.replace(plain, stop=(stop,)) for stop in stops]
    pickling = dist.broadcast_object_list
    dist.broadcast_object_list = _refuse_pickling
    try:
        return run(DynamicInferenceEngine(model, **engine_args), prompts(LENGTHS), params)
    finally:
        dist.broadcast_object_list = pickling


def _refuse_pickling(*args, **kwargs):
    raise AssertionError("a step shared a pickled object (broadcast_object_list)")


def _single_and_parallel_text(tp: int, pp: int):
    return _text_outputs(1, 1), _text_outputs(tp, pp)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_text_and_stop_sequences_agree_on_every_rank_and_with_one_process(tp, pp):
    outcomes = run_distributed(_single_and_parallel_text, 2, tp, pp)
    single, ranks = outcomes[0][0], [parallel for _, parallel in outcomes]
    assert {r["finish_reason"] for r in single.values()} == {"stop"}
    for results in ranks:  # every rank (each pipeline stage under PP) reports the same text
        for request_id, want in single.items():
            got = results[request_id]
            assert (got["tokens"], got["text"], got["finish_reason"], got["terminal"]) == (
                want["tokens"],
                want["text"],
                want["finish_reason"],
                1,
            )
            torch.testing.assert_close(got["log_probs"], want["log_probs"], rtol=0, atol=1e-4)
