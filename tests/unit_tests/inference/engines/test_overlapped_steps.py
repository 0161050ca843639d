"""Overlapped steps (the host prepares step N+1 before step N's tokens are read back) and the
static-buffer decode steps of the CUDA-graph path (run eagerly on the CPU) change no output:
under a NaN-poisoned tight pool (pauses, evictions, pending tokens on the async-preparation
path) they give exactly the tokens and log-probs of a synchronous roomy run; every request gets
one terminal output, aborts work in every state, and logits processors act before sampling."""

import dataclasses

import pytest
import torch

from megatron.core.inference import host_copies
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.inference.engines.common import (
    HostReads,
    assert_same_outputs,
    collect,
    gpt_model,
    hybrid_model,
    prompts,
    run,
)
from tests.unit_tests.inference.engines.test_saturation import (
    ENGINE_ARGS,
    NEW_TOKENS,
    PARAMS,
    PROMPT_LENGTHS,
    PoolWatch,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

MODELS = {"gpt": gpt_model, "hybrid": hybrid_model}


def _tight_run(model, pg, params, **modes):
    engine = DynamicInferenceEngine(
        model, num_blocks=10, paused_block_budget=3, pg_collection=pg, **ENGINE_ARGS, **modes
    )
    watch = PoolWatch(engine)
    results = run(engine, prompts(PROMPT_LENGTHS), params, on_step=watch.after_step)
    return results, engine, watch


# A mixed (prefill) step that samples at most each request's last row runs on the static buffers
# too: every such step without prompt log-probs, and with them the steps after the prompt's (a
# re-admitted request recomputes its prompt without them).
@pytest.mark.parametrize("prompt_log_probs", [True, False], ids=["prompt-logprobs", "sampled-only"])
@pytest.mark.parametrize("kind", list(MODELS))
@on_single_rank
def test_tight_pool_overlapped_and_static_buffer_steps_give_the_roomy_synchronous_outputs(pg, kind, prompt_log_probs):
    model = MODELS[kind](pg)
    params = dataclasses.replace(PARAMS, return_prompt_logprobs=prompt_log_probs)
    roomy = run(
        DynamicInferenceEngine(model, num_blocks=100, paused_block_budget=100, pg_collection=pg, **ENGINE_ARGS),
        prompts(PROMPT_LENGTHS),
        params,
    )
    for graphs in (False, True):
        modes = dict(overlap_steps=True, enable_cuda_graphs=graphs)
        tight, engine, watch = _tight_run(model, pg, params, **modes)
        stats, page_inits = engine.stats, engine.context.private_page_init_counts
        assert stats["pauses"] > 0 and stats["evictions"] > 0, modes
        assert page_inits["async_preparation"] > 0 and page_inits["admission"] > 0 and page_inits["resume"] > 0
        assert watch.nonfinite_owned_pages == 0 and watch.max_decoding_together >= 2
        assert (stats["graph_steps"] > 0) == graphs
        assert (stats["graph_mixed_steps"] > 0) == graphs, modes
        assert_same_outputs(tight, roomy)
        assert all(r["terminal"] == 1 and len(r["tokens"]) == NEW_TOKENS for r in tight.values())
        assert engine.context.num_requests == 0 and engine.context.num_free_blocks == 10


@on_single_rank
def test_overlapped_steps_in_a_tight_pool_pause_and_evict_no_more_than_steps_run_one_by_one(pg):
    """Short of blocks, the engine finishes the step in flight before scheduling the next, so the
    requests it ends free their blocks first (before, overlapped steps paused and evicted requests
    those were about to make room for: 27 pauses, 24 evictions and 952 prefill tokens here,
    against 17, 14 and 529 one by one); the steps with room still overlap."""
    model = gpt_model(pg)
    stats = {}
    for overlap in (False, True):
        _, engine, _ = _tight_run(model, pg, PARAMS, overlap_steps=overlap)
        stats[overlap] = engine.stats
    for key in ("pauses", "evictions", "prefill_tokens_computed"):
        assert 0 < stats[True][key] <= stats[False][key], key
    assert engine.context.private_page_init_counts["async_preparation"] > 0  # overlapped steps ran


def _run_staggered(engine, requests, params) -> dict:
    """Run the first request until it reports a token (its prompt blocks are then cached), then
    the others too."""
    results = {}
    engine.add_request("0", requests[0], params[0])
    while "0" not in results or not results["0"]["tokens"]:
        collect(results, engine.step())
    for index in range(1, len(requests)):
        engine.add_request(str(index), requests[index], params[index])
    while engine.has_unfinished_requests():
        collect(results, engine.step())
    return results


@on_single_rank
def test_overlapped_steps_keep_seeds_stops_top_logprobs_and_prefix_caching(pg):
    model = gpt_model(pg)
    shared = prompts([9], seed=8)[0]
    requests = [shared + tail for tail in prompts([3, 7, 1, 5], seed=9)] + prompts([12, 2], seed=10)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=True, top_logprobs=3, return_prompt_logprobs=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=14, logprobs=True, top_logprobs=2)
    params = [greedy, seeded, greedy, dataclasses.replace(seeded, seed=4), greedy, seeded]
    args = dict(
        block_size=4,
        num_blocks=64,
        max_tokens_per_step=12,
        max_sequence_length=48,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        pg_collection=pg,
    )
    plain = run(DynamicInferenceEngine(model, **args), requests, params)
    eos = plain["2"]["tokens"][4]  # request 2 (and maybe others) meets it as an end-of-sequence token
    sync = _run_staggered(DynamicInferenceEngine(model, eos_token_id=eos, **args), requests, params)
    engine = DynamicInferenceEngine(model, eos_token_id=eos, overlap_steps=True, **args)
    overlapped = _run_staggered(engine, requests, params)
    assert_same_outputs(overlapped, sync)
    assert sync["2"]["finish_reason"] == "stop" and len(sync["2"]["tokens"]) == 5
    assert engine.stats["prefix_cache_hits"] > 0
    for result, p in zip((overlapped[str(i)] for i in range(6)), params, strict=True):
        assert result["terminal"] == 1 and len(result["top_log_probs"]) == len(result["tokens"])
        assert {len(row) for row in result["top_log_probs"]} == {p.top_logprobs}


@on_single_rank
def test_decodes_left_out_of_overlapped_steps_twice_keep_their_prefix_cache_chain(pg):
    """Two decoding requests whose returned token fills a block (prompts of 5, block size 4) are
    left out of two steps in a row by whole-step prompts (deferred, then run first). With
    overlapped steps the chain had hashed that token before any step computed its KV, and the
    scheduler's draft drop rehashed only the computed tokens: the engine raised ValueError. Now it
    gives the tokens of synchronous steps."""
    model = gpt_model(pg)
    requests = prompts([5, 5, 8, 8, 8], seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=10)] * 2 + [SamplingParams(temperature=0.0, max_tokens=4)] * 3
    args = dict(
        block_size=4,
        num_blocks=64,
        max_tokens_per_step=8,
        max_requests=8,
        max_sequence_length=32,
        enable_prefix_caching=True,
        pg_collection=pg,
    )
    results = {}
    for overlap in (False, True):
        engine = DynamicInferenceEngine(model, overlap_steps=overlap, **args)
        got = {}
        for index in range(2):
            engine.add_request(str(index), requests[index], params[index])
        for step in range(100):
            collect(got, engine.step())
            if step == 1:  # the decodes have a token in flight
                for index in range(2, 5):
                    engine.add_request(str(index), requests[index], params[index])
            if not engine.has_unfinished_requests():
                break
        results[overlap] = got
    assert_same_outputs(results[True], results[False])
    assert [len(results[True][str(i)]["tokens"]) for i in range(5)] == [10, 10, 4, 4, 4]


@on_single_rank
def test_abort_in_every_state_of_overlapped_steps_gives_one_terminal_output(pg):
    engine = DynamicInferenceEngine(
        gpt_model(pg),
        block_size=4,
        num_blocks=6,
        max_requests=2,
        max_tokens_per_step=8,
        max_sequence_length=24,
        paused_block_budget=6,
        overlap_steps=True,
        pg_collection=pg,
    )
    for index, prompt in enumerate(prompts([6, 6, 4])):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=15))
    outputs = []
    while not engine.scheduler.paused:
        outputs += engine.step()
    paused = engine.scheduler.paused[0].request_id
    running = next(r.request_id for r in engine.scheduler.admitted if r.request_id != paused)
    assert engine._in_flight is not None and running in [s.request.request_id for s in engine._in_flight.scheduled]
    assert engine.scheduler.waiting[0].request_id == "2"
    for request_id in ("2", paused, running):  # waiting, paused, in the step in flight
        engine.abort(request_id)
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    terminal = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in terminal) == ["0", "1", "2"]
    assert all(o.finish_reason == "abort" for o in terminal)
    assert engine.context.num_free_blocks == 6 and engine.context.num_requests == 0
    assert engine.step() == []


class BanToken:
    """A logits processor: request ``request_id`` may never pick ``token``."""

    def __init__(self, request_id: str, token: int):
        self.request_id, self.token = request_id, token
        self.calls = 0

    def __call__(self, logits: torch.Tensor, request_ids) -> None:
        self.calls += 1
        for row, request_id in enumerate(request_ids):
            if request_id == self.request_id:
                logits[row, self.token] = float("-inf")


@on_single_rank
def test_logits_processors_act_before_sampling_in_every_mode(pg):
    model = gpt_model(pg)
    requests = prompts([5, 8])
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True)
    args = dict(block_size=4, num_blocks=32, max_tokens_per_step=16, max_sequence_length=32, pg_collection=pg)
    plain = run(DynamicInferenceEngine(model, **args), requests, params)
    banned = plain["0"]["tokens"][2]
    runs = []
    for modes in ({}, dict(overlap_steps=True), dict(overlap_steps=True, enable_cuda_graphs=True)):
        processor = BanToken("0", banned)
        runs.append(
            run(DynamicInferenceEngine(model, logits_processors=[processor], **modes, **args), requests, params)
        )
        assert processor.calls > 0
    for result in runs:
        assert result == runs[0]
        assert result["0"]["tokens"][:2] == plain["0"]["tokens"][:2] and banned not in result["0"]["tokens"]
        assert result["1"] == plain["1"]  # the other request is untouched


@on_single_rank
def test_overlapped_graph_decode_steps_read_nothing_back_but_their_decisions(pg, monkeypatch):
    """A decode step of the overlapped graph path (its static-buffer step eagerly on the CPU)
    reads no tensor value on the host (on CUDA each such read is a sync) and waits on one
    read-back: the decisions of the step before."""
    engine = DynamicInferenceEngine(
        gpt_model(pg), enable_cuda_graphs=True, overlap_steps=True, num_blocks=64, pg_collection=pg, **ENGINE_ARGS
    )
    waits = []
    wait = host_copies.DeviceToHost.wait
    monkeypatch.setattr(host_copies.DeviceToHost, "wait", lambda self: waits.append(1) or wait(self))
    for index, prompt in enumerate(prompts([3, 2])):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=True))
    while engine.stats["graph_steps"] < 1:  # prefill, then a decode step in flight
        engine.step()
    waits.clear()
    with HostReads() as watch:
        outputs = engine.step()
    assert engine.stats["graph_steps"] == 2 and [len(out.new_token_ids) for out in outputs] == [1, 1]
    assert watch.reads == [] and len(waits) == 1
