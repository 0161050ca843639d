"""benchmarks/gpu_decode.py's host profile: each phase of an engine step timed around the
engine's own methods, which are the class's again afterwards (the engine's outputs unchanged)."""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu_decode import HOST_PHASES, build_models, engine_for, host_phases, make_prompts
from megatron.core.inference.sampling import SamplingParams
from tests.unit_tests.transformer.single_rank import on_single_rank


def _engine(pg):
    args = argparse.Namespace(tiny=True, prompt_tokens=8, new_tokens=12, max_tokens_per_step=256)
    _, model = build_models("gpt", args, pg, torch.device("cpu"))
    engine = engine_for(model, pg, args, max_requests=4)
    for index, prompt in enumerate(make_prompts(4, 8, 64, seed=3)):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=12))
    for _ in range(2):  # prefill
        engine.step()
    return engine


def _drain(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@on_single_rank
def test_each_phase_is_timed_and_the_engine_is_restored(pg):
    timed, plain = _engine(pg), _engine(pg)
    owners = [timed if owner is None else getattr(timed, owner) for owner, _, _ in HOST_PHASES]
    phases = host_phases(timed, 4)
    # Every phase a CPU decode step runs (no graphs on CPU: the eager forward), each once a step.
    labels = {"step", "schedule", "build_step", "eager forward", "sample", "decisions (incl. read-back wait)", "apply"}
    assert set(phases) == labels
    assert all(0 < ms < phases["step"] for label, ms in phases.items() if label != "step")  # parts of a step
    for owner, (_, name, _) in zip(owners, HOST_PHASES, strict=True):
        assert owner is None or name not in vars(owner)  # the class's method again
    for _ in range(4):  # the same steps on the untimed twin
        plain.step()
    assert _drain(timed) == _drain(plain)
