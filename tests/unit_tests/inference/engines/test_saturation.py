"""A pool far too small for the load pauses and evicts requests but never changes outputs:
tokens, prompt log-probs and generated log-probs equal those of a roomy pool exactly (on the
CPU reference kernels; see ``assert_same_outputs``), and every
page a request owns is initialized (stale NaN in free pages never reaches a request)."""

import pytest
import torch

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.engines.common import assert_same_outputs, gpt_model, hybrid_model, prompts, run
from tests.unit_tests.transformer.single_rank import on_single_rank

PROMPT_LENGTHS = [3, 11, 6, 14, 9, 4, 13, 7]
NEW_TOKENS = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=True, return_prompt_logprobs=True)
ENGINE_ARGS = dict(
    block_size=8, max_tokens_per_step=16, max_sequence_length=80, max_requests=8, enable_chunked_prefill=True
)


class PoolWatch:
    """NaN-fills every page no request owns (before the run and whenever one is freed) and
    records, after each step, owned pages holding non-finite values and decode batch sizes."""

    def __init__(self, engine: DynamicInferenceEngine):
        self.context = context = engine.context
        self.engine = engine
        pool = context.pool
        context.kv_cache.data[:, :, : pool.num_blocks] = float("nan")
        free = pool.free

        def free_and_poison(block_ids):
            free(block_ids)
            dead = [b for b in block_ids if pool.ref_count(b) == 0]
            if dead:
                context.kv_cache.data[:, :, dead] = float("nan")

        pool.free = free_and_poison
        build_step = context.build_step
        self.max_decoding_together = 0

        def recording_build_step(schedule, **kwargs):
            batch = build_step(schedule, **kwargs)
            self.max_decoding_together = max(self.max_decoding_together, int((batch.query_lengths == 1).sum()))
            return batch

        context.build_step = recording_build_step
        self.nonfinite_owned_pages = 0

    def after_step(self, engine) -> None:
        for request in engine.scheduler.admitted:
            blocks = self.context.request(request.request_id).block_ids
            self.nonfinite_owned_pages += int((~torch.isfinite(self.context.kv_cache.data[:, :, blocks])).any())


def _generate(pg, build_model, num_blocks: int, paused_block_budget: int, skip_page_init: bool = False):
    # Steps one by one, whose decode growth takes pages on the decode_growth path (overlapped
    # steps, the default on a GPU, take them ahead on the async_preparation path: test_overlapped_steps.py).
    engine = DynamicInferenceEngine(
        build_model(pg),
        num_blocks=num_blocks,
        paused_block_budget=paused_block_budget,
        overlap_steps=False,
        pg_collection=pg,
        **ENGINE_ARGS,
    )
    engine.context._skip_private_page_init_for_tests = skip_page_init
    watch = PoolWatch(engine)
    results = run(engine, prompts(PROMPT_LENGTHS), PARAMS, on_step=watch.after_step)
    return results, engine.stats, dict(engine.context.private_page_init_counts), watch


MODELS = {"gpt": gpt_model, "hybrid": hybrid_model}


@pytest.mark.parametrize("kind", list(MODELS))
@on_single_rank
def test_tight_pool_pauses_and_evicts_without_changing_outputs(pg, kind):
    roomy, _, _, _ = _generate(pg, MODELS[kind], num_blocks=100, paused_block_budget=100)
    tight, stats, page_inits, watch = _generate(pg, MODELS[kind], num_blocks=10, paused_block_budget=3)

    assert stats["pauses"] > 0 and stats["evictions"] > 0
    assert watch.max_decoding_together >= 2
    assert page_inits["admission"] > 0 and page_inits["decode_growth"] > 0 and page_inits["resume"] > 0
    assert watch.nonfinite_owned_pages == 0
    assert_same_outputs(tight, roomy)
    for request_id in roomy:
        got = tight[request_id]
        assert got["terminal"] == 1 and got["finish_reason"] == "length"
        assert len(got["tokens"]) == NEW_TOKENS
        assert len(got["prompt_log_probs"]) == PROMPT_LENGTHS[int(request_id)] - 1


@on_single_rank
def test_skipping_private_page_init_leaves_nan_in_owned_pages(pg):
    _, stats, _, watch = _generate(pg, gpt_model, num_blocks=10, paused_block_budget=3, skip_page_init=True)
    assert stats["evictions"] > 0
    assert watch.nonfinite_owned_pages > 0
