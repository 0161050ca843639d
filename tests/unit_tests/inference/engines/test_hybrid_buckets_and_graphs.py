"""Hybrid (Mamba + attention) models under bucket padding and CUDA-graph decode: the Mamba
decode step is row invariant (checked by the engine's bucket check, which catches a step that is
not), bucket-padded steps give the outputs of unpadded ones (bitwise on the CPU), padding rows
never touch a live request's Mamba state, the static-buffer decode step reads nothing back to the
host, and decode steps from graphs (replayed on CUDA, the same static-buffer step run eagerly on
the CPU) give exactly the tokens and log-probs of eager steps."""

import dataclasses

import torch

from megatron.core.inference import kernels
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.engines.cuda_graphs import GraphKey, StepGraphs
from megatron.core.inference.engines.step_buckets import StepBuckets, row_invariant_buckets
from megatron.core.inference.sampling import SamplingParams
from megatron.core.ssm.backends import TorchSSMBackend
from megatron.core.ssm.mamba_mixer import MambaMixer
from tests.unit_tests.dist_harness import device
from tests.unit_tests.inference.engines.common import (
    HostReads,
    assert_same_outputs,
    collect,
    hybrid_model,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=True, return_prompt_logprobs=True)
ARGS = dict(block_size=4, num_blocks=128, max_requests=8, max_tokens_per_step=32, max_sequence_length=96)
LENGTHS = [9, 3, 14, 6, 2]
# Requests ending at different times: decode steps of 5, 4, 3 and 2 requests.
STAGGERED = [dataclasses.replace(GREEDY, max_tokens=n) for n in (10, 3, 8, 5, 10)]


def _record_steps(engine) -> list[tuple[int, int]]:
    """``(tokens, padded tokens)`` of every step the engine builds from now on."""
    steps = []
    build_step = engine.context.build_step

    def recording(schedule, **kwargs):
        batch = build_step(schedule, **kwargs)
        steps.append((sum(n for _, n in schedule), batch.num_padded_tokens))
        return batch

    engine.context.build_step = recording
    return steps


@on_single_rank
def test_hybrid_bucket_padded_steps_give_the_unpadded_outputs(pg, monkeypatch):
    model = hybrid_model(pg)
    token_by_token, recurrence = MambaMixer._packed_token_by_token, TorchSSMBackend.token_recurrence
    prefill_calls, step_size = [], []  # (rows of a one-token update, its prefill step's padded size)

    def recording_prefill(self, backend, xBC, *args):
        step_size.append(xBC.shape[0])
        try:
            return token_by_token(self, backend, xBC, *args)
        finally:
            step_size.clear()

    def recording_recurrence(*args):
        calls = args[-2]
        prefill_calls.extend((call.stop - call.start, step_size[0]) for call in calls if step_size)
        return recurrence(*args)

    monkeypatch.setattr(MambaMixer, "_packed_token_by_token", recording_prefill)
    monkeypatch.setattr(TorchSSMBackend, "token_recurrence", staticmethod(recording_recurrence))
    padded = DynamicInferenceEngine(
        model, enable_cuda_graphs=False, enable_chunked_prefill=True, pg_collection=pg, **ARGS
    )
    assert len(padded.buckets.sizes) > 2, padded.buckets  # the Mamba step passed the check at several sizes
    unpadded = DynamicInferenceEngine(
        model, enable_cuda_graphs=False, enable_chunked_prefill=True, pg_collection=pg, **ARGS
    )
    unpadded.buckets = StepBuckets(list(range(1, ARGS["max_tokens_per_step"] + 1)))  # every size: no padding
    padded_steps, unpadded_steps = _record_steps(padded), _record_steps(unpadded)
    want = run(unpadded, prompts(LENGTHS), STAGGERED)
    prefill_calls.clear()
    got = run(padded, prompts(LENGTHS), STAGGERED)
    # The prefill steps' token-by-token recurrence runs each position's requests at the smallest
    # checked bucket that holds them, not at the step's padded size.
    if kernels.kernel_backend(device()) == "torch":
        assert prefill_calls and {rows for rows, _ in prefill_calls} <= set(padded.buckets.sizes)
        assert any(rows < size for rows, size in prefill_calls)
    else:  # the Triton packed recurrence runs over the whole step in place, no token-by-token calls
        assert not prefill_calls
    assert all(tokens == rows for tokens, rows in unpadded_steps)
    assert any(rows > tokens for tokens, rows in padded_steps)
    assert any(rows > tokens == 3 for tokens, rows in padded_steps)  # a decode step of 3 ran at bucket 4
    assert_same_outputs(got, want)  # bitwise on the CPU


@on_single_rank
def test_bucket_check_drops_the_sizes_where_a_mamba_decode_step_is_not_row_invariant(pg, monkeypatch):
    model = hybrid_model(pg)
    candidates = [1, 2, 4, 8]
    with kernels.batch_invariant(True):
        assert row_invariant_buckets(model, candidates, pg) == candidates
        packed_step = MambaMixer._packed_step

        def batch_dependent_step(self, backend, xBC, dt, inference_context):
            # A step whose rows depend on the others (a mean over the batch), as a kernel that
            # splits its work by the row count would.
            y = packed_step(self, backend, xBC, dt, inference_context)
            return y + 1e-3 * y.mean(dim=0, keepdim=True)

        monkeypatch.setattr(MambaMixer, "_packed_step", batch_dependent_step)
        assert row_invariant_buckets(model, candidates, pg) == [8]


def _static_decode_engine(model, pg, **kwargs) -> DynamicInferenceEngine:
    """An engine whose decode steps run on the static buffers at its buckets: replayed from CUDA
    graphs where the stage can be captured, and elsewhere (the CPU; a CUDA stage with a
    ``cuda_graphs_blocker``, where ``enable_cuda_graphs=True`` is refused) the same steps eagerly."""
    on_cpu = device().type == "cpu"
    engine = DynamicInferenceEngine(
        model, enable_cuda_graphs=True if on_cpu else None, pg_collection=pg, **ARGS, **kwargs
    )
    if engine.graphs is None:
        engine.graphs = StepGraphs(
            engine.runner, engine.context, engine.buckets.sizes, capture=False, mixed_steps=False
        )
    assert engine.graphs.capturing == (not on_cpu and engine.cuda_graphs_blocker is None)
    return engine


def _padded_bucket(engine, num_requests: int) -> int:
    """The smallest decode bucket of ``engine`` with room for a padding request past ``num_requests``
    (the buckets are those the model passed the row-invariance check at, on its device)."""
    return engine.graphs.key_for(num_requests + 1, num_requests + 1, True).tokens


def _decode_all(engine, requests) -> dict:
    """Add ``requests`` and step until each of them has a token to decode."""
    results = {}
    for index, prompt in enumerate(requests):
        engine.add_request(str(index), prompt, GREEDY)
    while any(not results.get(str(i), {}).get("tokens") for i in range(len(requests))):
        collect(results, engine.step())
    return results


@on_single_rank
def test_padding_requests_of_a_static_decode_step_touch_no_live_mamba_state(pg):
    engine = _static_decode_engine(hybrid_model(pg), pg, overlap_steps=False)
    _decode_all(engine, prompts([5, 7, 3]))
    context, slots = engine.context, engine.context.mamba_slots
    live = {rid: context.request(rid).mamba_slot for rid in ("0", "1", "2")}
    before = slots.conv.clone(), slots.ssm.clone()
    bucket = _padded_bucket(engine, 1)
    batch = context.build_step([("1", 1)], pad_to_tokens=bucket, pad_to_requests=bucket)
    assert batch.mamba_slot_ids.tolist() == [live["1"]] + [slots.scratch_slot] * (bucket - 1)
    engine.graphs.run(GraphKey(bucket, bucket, True), batch)
    context.commit_step()
    for rid, slot in live.items():
        changed = [
            not torch.equal(now[:, slot], then[:, slot])
            for now, then in zip((slots.conv, slots.ssm), before, strict=True)
        ]
        assert changed == [rid == "1"] * 2, rid  # only the stepped request's state moved


@on_single_rank
def test_static_buffer_mamba_decode_step_reads_nothing_back_to_the_host(pg):
    # A Mamba + MLP model: the torch paged attention of the CPU reads lengths (a CUDA graph takes
    # the Triton one), the Mamba decode step must not.
    engine = _static_decode_engine(hybrid_model(pg, pattern="M-M"), pg, overlap_steps=False)
    _decode_all(engine, prompts([5, 7, 3]))
    bucket = _padded_bucket(engine, 2)
    batch = engine.context.build_step([("0", 1), ("2", 1)], pad_to_tokens=bucket, pad_to_requests=bucket)
    with kernels.batch_invariant(True), HostReads() as watch:
        engine.graphs.run(GraphKey(bucket, bucket, True), batch)
    engine.context.commit_step()
    assert watch.reads == []


@on_single_rank
def test_hybrid_decode_graphs_give_exactly_the_eager_outputs(pg):
    model = hybrid_model(pg)
    engines = {
        "graphs": _static_decode_engine(model, pg),
        "eager": DynamicInferenceEngine(model, enable_cuda_graphs=False, pg_collection=pg, **ARGS),
    }
    graphs = engines["graphs"].graphs
    assert engines["eager"].graphs is None
    assert graphs.buckets == [1, 2, 4, 8]  # steps go to 32 tokens, decode steps to max_requests=8
    assert engines["graphs"].mixed_step_graphs_blocker is None and graphs.mixed_buckets == [1, 2, 4, 8, 16, 32]
    # On CUDA the decode steps are captured and replayed; on the CPU the same static-buffer step
    # runs eagerly.
    capturable = device().type == "cuda"
    assert graphs.capturing == capturable
    assert (engines["graphs"].cuda_graphs_blocker is None) == capturable
    results = {name: run(engine, prompts(LENGTHS), STAGGERED) for name, engine in engines.items()}
    assert engines["graphs"].stats["graph_steps"] > 0 and engines["eager"].stats["graph_steps"] == 0
    for request_id, expected in results["eager"].items():
        for key in ("tokens", "log_probs", "prompt_log_probs", "finish_reason"):
            assert results["graphs"][request_id][key] == expected[key], (request_id, key)
