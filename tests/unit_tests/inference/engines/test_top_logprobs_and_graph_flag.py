"""Top-k log-probs (up to 20) are a log-softmax of the model's logits on every engine path (plain,
speculative, overlapped with static-buffer decode steps), and ``--no-cuda-graphs`` /
``--cuda-graphs`` reach the engine from both launchers."""

import pytest
import torch

from megatron.core.inference import offline_inference
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import MAX_TOP_LOGPROBS, InvalidSamplingParamsError, SamplingParams
from megatron.core.inference.server import launcher
from tests.unit_tests.dist_harness import device
from tests.unit_tests.inference.engines.common import (
    VOCAB,
    assert_same_outputs,
    gpt_model,
    mtp_model_with_tied_heads,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

ARGS = dict(block_size=4, num_blocks=128, max_requests=8, max_tokens_per_step=32, max_sequence_length=96)


@torch.no_grad()
def _reference_top_log_probs(model, prompt: list[int], generated: list[int], count: int) -> list[list[tuple]]:
    """Per generated position, the ``count`` most likely tokens of a cache-free forward over the
    prompt and the tokens generated before it, with their log-softmax values."""
    tokens = torch.tensor([prompt + generated], device=device())
    logits = model(tokens)[0, len(prompt) - 1 : -1, :VOCAB].float()
    values, ids = torch.log_softmax(logits, dim=-1).topk(count, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def _assert_top_log_probs_match_reference(model, requests, params, results) -> None:
    for index, (prompt, p) in enumerate(zip(requests, params, strict=True)):
        result = results[str(index)]
        expected = _reference_top_log_probs(model, prompt, result["tokens"], p.top_logprobs)
        assert len(result["top_log_probs"]) == len(result["tokens"]) == p.max_tokens
        for got, want in zip(result["top_log_probs"], expected, strict=True):
            assert [t for t, _ in got] == [t for t, _ in want]
            torch.testing.assert_close([lp for _, lp in got], [lp for _, lp in want], rtol=0, atol=1e-5)
        # The sampled token's log-prob is its entry in the same distribution.
        for token, log_prob, want in zip(result["tokens"], result["log_probs"], expected, strict=True):
            if token in dict(want):
                torch.testing.assert_close(log_prob, dict(want)[token], rtol=0, atol=1e-5)


@on_single_rank
def test_top_logprobs_up_to_20_are_the_models_log_softmax_with_and_without_speculation(pg):
    requests = prompts([5, 9, 3, 6])
    greedy = SamplingParams(temperature=0.0, max_tokens=16, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS)
    sampled = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=16, logprobs=True, top_logprobs=5)
    params = [greedy, greedy, sampled, SamplingParams(temperature=0.0, max_tokens=16, logprobs=True, top_logprobs=1)]
    model = mtp_model_with_tied_heads(pg)
    plain = run(DynamicInferenceEngine(model, pg_collection=pg, **ARGS), requests, params)
    engine = DynamicInferenceEngine(model, num_speculative_tokens=2, pg_collection=pg, **ARGS)
    speculative = run(engine, requests, params)
    assert engine.stats["drafts_accepted"] > 0 and engine.stats["drafts_rejected"] > 0
    assert_same_outputs(speculative, plain)
    _assert_top_log_probs_match_reference(model, requests, params, plain)
    assert {len(row) for row in plain["0"]["top_log_probs"]} == {20}


@on_single_rank
def test_top_logprobs_in_overlapped_static_buffer_steps_are_the_models_log_softmax(pg):
    requests = prompts([7, 2, 11])
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=True, top_logprobs=k) for k in (20, 3, 0)]
    model = gpt_model(pg)
    engine = DynamicInferenceEngine(model, overlap_steps=True, enable_cuda_graphs=True, pg_collection=pg, **ARGS)
    results = run(engine, requests, params)
    assert engine.stats["graph_steps"] > 0
    _assert_top_log_probs_match_reference(model, requests[:2], params[:2], results)
    assert results["2"]["top_log_probs"] is None  # asked for none


def test_top_logprobs_above_20_are_refused_with_the_accepted_range():
    with pytest.raises(InvalidSamplingParamsError, match=r"top_logprobs must be an integer in \[0, 20\], got 21"):
        SamplingParams(logprobs=True, top_logprobs=21)


@pytest.mark.parametrize(
    "parse, base",
    [(launcher.parse_args, ["--load", "ckpt"]), (offline_inference.parse_args, ["--prompts", "hi"])],
    ids=["megatron-serve", "offline"],
)
def test_cuda_graph_flags_parse_to_on_off_or_the_engine_default(parse, base):
    assert parse(base).enable_cuda_graphs is None
    assert parse([*base, "--no-cuda-graphs"]).enable_cuda_graphs is False
    assert parse([*base, "--cuda-graphs"]).enable_cuda_graphs is True


@on_single_rank
def test_serve_engine_runs_static_decode_steps_only_with_cuda_graphs_on(pg):
    model = gpt_model(pg)
    results, graph_steps = {}, {}
    for flag in ("--cuda-graphs", "--no-cuda-graphs"):
        engine = launcher.build_engine(launcher.parse_args(["--load", "ckpt", flag]), model, None, pg)
        results[flag] = run(engine, prompts([4, 9]), SamplingParams(temperature=0.0, max_tokens=6, logprobs=True))
        graph_steps[flag] = engine.stats["graph_steps"]
        assert (engine.graphs is None) == (flag == "--no-cuda-graphs")
    assert graph_steps["--cuda-graphs"] > 0 and graph_steps["--no-cuda-graphs"] == 0
    assert_same_outputs(results["--cuda-graphs"], results["--no-cuda-graphs"])
