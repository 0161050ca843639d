"""The engine under TP2 and PP2 (real gloo ranks) gives the outputs of one process, with
pauses, evictions and speculative decoding (MTP heads on the last stage) in lockstep."""

import pytest
import torch

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
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
    # A tight pool, so pauses and evictions run in lockstep on every rank too.
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
