"""Decode speed on one GPU: our engine (CUDA graphs on and off, default batch-invariant mode) vs
HuggingFace ``generate`` on the same random weights, in one run.

Models (bf16, random weights built in HF and converted with ``hf_mapping``):

- gpt: the 1.4B Llama-style model of issue 14 (24 layers, hidden 2048, 16 heads, 16 KV heads,
  SwiGLU ffn 5504, vocab 50304, untied, RoPE).
- hybrid: the hybrid of the training benchmark (``M-M-M-M*-M-M-M-M*-M-M-M-``, hidden 2048,
  Mamba-2 state 128, head dim 64, 8 groups, ffn 8192, 16 heads), as a NemotronH model.

At each concurrency (1, 8, 64, 256 requests of 128 random prompt tokens, 128 new tokens each,
greedy, EOS ignored) it measures output tokens/s and time to first token, from the run of median
time of ``--trials`` (3) in which every side runs in turn, of:

- ours with graphs (``enable_cuda_graphs`` left to the engine: graphs where the stage can be
  captured; the JSON says why not where not) and ours eager (``enable_cuda_graphs=False``),
  after a warm-up run of the same size; the two must give identical tokens and log-probs; and
  ours unpadded (``batch_invariant=False``; ``--no-unpadded`` leaves it out): the default mode
  must not be slower than it;
- HF ``generate`` (SDPA), one call over all prompts left-padded, after a full-size warm-up
  call, with its dynamic cache, and with ``cache_implementation="static"`` (compiled) where the
  model supports it.

The HBM roofline: bytes one decode step reads (weights, the live KV of every request at the
mean context, Mamba states read and written) over the bandwidth of a >= 1 GiB device-to-device
``copy_`` (read + write counted); a run's % of roofline is its output tokens/s over the
roofline's. At batch 1 it also prints the time per decode step over the weights-read time.
A run that exceeds ``--run-budget-s`` is stopped (HF through ``max_time``) and reported as such,
and a model's rows not started within ``--model-budget-s`` are reported as skipped, so the whole
benchmark stays within a bounded time; the JSON is rewritten after every row.

    python -m benchmarks.gpu_decode --output-json $OUT/gpu_decode.json
    python -m benchmarks.gpu_decode --models gpt --concurrency 1,64 --hf-static-concurrency 64
    python -m benchmarks.gpu_decode --tiny --device cpu        (a smoke run of every code path)

``--profile-steps N`` also runs ``torch.profiler`` over the prefill steps and then N decode steps of
the default engine (graphs where captured) at each concurrency: per step of each phase the wall
time and the GPU busy time (the union of the kernels' intervals), the kernels with the most device
time, the CUDA runtime calls with the most host time, and (over as many more steps, timed without a
profiler) the host's wall time per step in each phase of the engine's step, the wait for the
device included (:func:`host_phases`), in the row's ``profile``.

    python -m benchmarks.gpu_decode --models gpt --concurrency 1,64 --no-unpadded --profile-steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from megatron.core import parallel_state
from megatron.core.benchmark_report import busy_us, finish, write_report
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models import hf_mapping
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel

HYBRID_PATTERN = "M-M-M-M*-M-M-M-M*-M-M-M-"


def hf_config(kind: str, tiny: bool, max_positions: int):
    """The HF config of a benchmark model (``tiny``: the same structure, a few MB)."""
    from transformers import LlamaConfig, NemotronHConfig

    hidden, heads = (64, 4) if tiny else (2048, 16)
    vocab = 512 if tiny else 50304
    if kind == "gpt":
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=96 if tiny else 5504,
            num_hidden_layers=2 if tiny else 24,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
        )
    return NemotronHConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        hybrid_override_pattern="M-M*-" if tiny else HYBRID_PATTERN,
        layers_block_type=None,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=128 if tiny else 8192,
        mlp_hidden_act="relu2",
        mamba_num_heads=2 * hidden // (16 if tiny else 64),
        mamba_head_dim=16 if tiny else 64,
        n_groups=2 if tiny else 8,
        ssm_state_size=16 if tiny else 128,
        conv_kernel=4,
        chunk_size=16 if tiny else 128,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def build_models(kind: str, args, pg, device: torch.device):
    """HF's model (bf16, SDPA) and ours with the same weights, both in eval mode on ``device``."""
    from transformers import LlamaForCausalLM, NemotronHForCausalLM

    config = hf_config(kind, args.tiny, args.prompt_tokens + args.new_tokens)
    torch.manual_seed(0)
    hf_class = LlamaForCausalLM if kind == "gpt" else NemotronHForCausalLM
    with torch.device(device):
        hf = hf_class._from_config(config, torch_dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    overrides = dict(bf16=True, perform_initialization=False)
    if kind == "gpt":
        ours_config, kwargs = hf_mapping.llama_config_from_hf(hf.config, **overrides)
        ours = GPTModel(ours_config, get_gpt_layer_local_spec(), pg_collection=pg, **kwargs)
        state = hf_mapping.llama_state_dict_from_hf(hf.state_dict(), ours_config)
    else:
        ours_config, kwargs = hf_mapping.nemotron_h_config_from_hf(hf.config, **overrides)
        ours = HybridModel(ours_config, get_hybrid_stack_local_spec(), pg_collection=pg, **kwargs)
        state = hf_mapping.nemotron_h_state_dict_from_hf(hf.state_dict(), ours_config, kwargs["hybrid_layer_pattern"])
    ours.load_state_dict(state, strict=True)
    return hf, ours.to(device).eval()


def copy_bandwidth_bytes_per_s(device: torch.device, num_bytes: int) -> float:
    """Bytes moved per second by a device-to-device ``copy_`` of ``num_bytes`` (read + write),
    median of 10 after a warm-up."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    samples = []
    for _ in range(11):
        _sync(device)
        started = time.perf_counter()
        target.copy_(source)
        _sync(device)
        samples.append(time.perf_counter() - started)
    del source, target
    return 2 * num_bytes / statistics.median(samples[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_bytes(model, engine: DynamicInferenceEngine, num_requests: int, context_tokens: float) -> float:
    """Bytes one decode step of ``num_requests`` requests at ``context_tokens`` reads: the weights,
    each request's KV, and its Mamba states (read and written)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = engine.context.spec
    kv_element = torch.empty((), dtype=spec.kv_dtype).element_size()
    kv_per_token = len(spec.attention_layer_numbers) * 2 * spec.num_kv_heads * spec.head_dim * kv_element
    mamba = len(spec.mamba_layer_numbers) * spec.mamba_shapes.bytes_per_layer if spec.mamba_layer_numbers else 0
    return weights + num_requests * (kv_per_token * context_tokens + 2 * mamba)


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


def drive(engine: DynamicInferenceEngine, prompts, params, budget_s: float) -> dict:
    """Run ``prompts`` to completion (or abort them all past ``budget_s``): tokens and log-probs
    per request, first-token times, elapsed seconds, steps and steps run from CUDA graphs."""
    tokens, log_probs, first = {}, {}, {}
    before = {key: engine.stats[key] for key in ("steps", "graph_steps", "graph_mixed_steps")}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    timed_out = False
    while engine.has_unfinished_requests():
        if not timed_out and time.perf_counter() - started > budget_s:
            timed_out = True
            for index in range(len(prompts)):
                engine.abort(str(index))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            log_probs.setdefault(out.request_id, []).extend(out.new_log_probs)
            first.setdefault(out.request_id, time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    order = [str(i) for i in range(len(prompts))]
    return dict(
        tokens=[tokens.get(i, []) for i in order],
        log_probs=[log_probs.get(i, []) for i in order],
        first_token_s=[first.get(i, elapsed) for i in order],
        elapsed_s=elapsed,
        steps=engine.stats["steps"] - before["steps"],
        graph_steps=engine.stats["graph_steps"] - before["graph_steps"],
        graph_mixed_steps=engine.stats["graph_mixed_steps"] - before["graph_mixed_steps"],
        timed_out=timed_out,
    )


@torch.no_grad()
def hf_generator(hf, prompts, new_tokens: int, device: torch.device, budget_s: float, **options):
    """A function that times one left-padded ``generate`` call over all prompts; the full-size
    warm-up call (which compiles the static-cache forward) runs here, once."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)

    def call():
        return hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            max_time=budget_s,
            **options,
        )

    @torch.no_grad()
    def timed() -> dict:
        _sync(device)
        started = time.perf_counter()
        out = call()
        _sync(device)
        elapsed = time.perf_counter() - started
        generated = out[:, longest:].tolist()
        return dict(tokens=generated, elapsed_s=elapsed, timed_out=len(generated[0]) < new_tokens)

    call()  # warm-up at full size
    return timed


def median_run(runs: list[dict]) -> dict:
    """The run of median elapsed time (the upper median of an even count)."""
    return sorted(runs, key=lambda run: run["elapsed_s"])[len(runs) // 2]


def _kernel_summary(prof, num_steps: int, wall_s: float) -> dict:
    """Per step of a ``torch.profiler`` run over ``num_steps`` steps: wall and GPU busy
    milliseconds (the union of the kernels' intervals), kernel count, the 10 kernels with the
    most device time."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    totals: dict[str, list[float]] = {}
    for e in kernels:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:10]
    # CUDA runtime calls on the host (a launch that waits for the device shows up here).
    runtime: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith("cuda"):
            entry = runtime.setdefault(e.name, [0.0, 0])
            entry[0] += e.time_range.elapsed_us()
            entry[1] += 1
    return dict(
        steps=num_steps,
        wall_ms_per_step=1e3 * wall_s / num_steps,
        gpu_busy_ms_per_step=busy / 1e3 / num_steps,
        gpu_busy_fraction=busy / 1e6 / wall_s,
        kernels_per_step=len(kernels) / num_steps,
        top_kernels=[
            dict(name=name[:120], ms_per_step=total / 1e3 / num_steps, calls_per_step=count / num_steps)
            for name, (total, count) in top
        ],
        cuda_runtime_calls=[
            dict(name=name, ms_per_step=total / 1e3 / num_steps, calls_per_step=count / num_steps)
            for name, (total, count) in sorted(runtime.items(), key=lambda item: -item[1][0])[:8]
        ],
    )


def profile_decode(engine: DynamicInferenceEngine, prompts, params, num_steps: int, device: torch.device) -> dict:
    """``torch.profiler`` over the prefill steps of ``prompts`` (until every request has its first
    token; in ``prefill``) and then over ``num_steps`` decode steps with them all decoding: the
    :func:`_kernel_summary` of each, and the :func:`host_phases` of as many more decode steps."""
    from torch.profiler import ProfilerActivity, profile

    ids = [f"profile-{index}" for index in range(len(prompts))]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prefill_prof:
        started, prefill_steps = time.perf_counter(), 0
        for request_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(request_id, prompt, params)
        started_decoding = set()
        while len(started_decoding) < len(ids):  # prefill done: every request has a token
            started_decoding.update(out.request_id for out in engine.step() if out.new_token_ids)
            prefill_steps += 1
        _sync(device)
        prefill_wall_s = time.perf_counter() - started
    graph_steps = engine.stats["graph_steps"]
    _sync(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        _sync(device)
        wall_s = time.perf_counter() - started
    graph_steps = engine.stats["graph_steps"] - graph_steps
    host = host_phases(engine, num_steps)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return _kernel_summary(prof, num_steps, wall_s) | dict(
        graph_steps=graph_steps,
        host_ms_per_step=host,
        prefill=_kernel_summary(prefill_prof, prefill_steps, prefill_wall_s),
    )


# The host's part of an engine step, as (owner attribute of the engine or None, method, label).
HOST_PHASES = (
    ("scheduler", "schedule", "schedule"),
    ("context", "build_step", "build_step"),
    ("graphs", "run", "graph replay"),
    ("runner", "forward", "eager forward"),
    (None, "_sample", "sample"),
    (None, "_decisions", "decisions (incl. read-back wait)"),
    (None, "_apply", "apply"),
)


def host_phases(engine: DynamicInferenceEngine, num_steps: int) -> dict:
    """Median wall milliseconds per step, over ``num_steps`` more decode steps, of each phase of
    :data:`HOST_PHASES` (timed with ``perf_counter`` around the engine's own methods: no profiler
    slows its Python down, which under ``cProfile`` more than doubled it) and of the whole step.
    The decisions include the wait for the step's read-back: the host idling on the device."""
    spent: dict[str, float] = {}

    def timed(method, label):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - started

        return run

    wrapped = []
    for owner_name, name, label in HOST_PHASES:
        owner = engine if owner_name is None else getattr(engine, owner_name)
        if owner is not None:
            setattr(owner, name, timed(getattr(owner, name), label))
            wrapped.append((owner, name))
    per_step: dict[str, list[float]] = {"step": []}
    try:
        for _ in range(num_steps):
            spent.clear()
            started = time.perf_counter()
            engine.step()
            per_step["step"].append(time.perf_counter() - started)
            for label, seconds in spent.items():
                per_step.setdefault(label, []).append(seconds)
    finally:
        for owner, name in wrapped:
            delattr(owner, name)  # the class's method again
    return {label: 1e3 * statistics.median(values) for label, values in per_step.items()}


def engine_for(model, pg, args, max_requests: int, **modes) -> DynamicInferenceEngine:
    block_size = 16
    blocks_per_request = -(-(args.prompt_tokens + args.new_tokens) // block_size)
    return DynamicInferenceEngine(
        model,
        block_size=block_size,
        num_blocks=max_requests * blocks_per_request + 8,
        max_requests=max_requests,
        max_tokens_per_step=args.max_tokens_per_step,
        max_sequence_length=args.prompt_tokens + args.new_tokens,
        enable_chunked_prefill=True,
        pg_collection=pg,
        **modes,
    )


def _rate(num_requests: int, args, run: dict) -> float | None:
    return None if run["timed_out"] else num_requests * args.new_tokens / run["elapsed_s"]


def bench_model(kind: str, args, pg, device: torch.device, bandwidth: float, result: dict) -> dict:
    """Fill ``result`` (in the report: written after each row) with the model's rows."""
    started = time.monotonic()
    args.deadline = started + args.model_budget_s
    hf, ours = build_models(kind, args, pg, device)
    print(f"{kind}: models built in {time.monotonic() - started:.0f} s", flush=True)
    vocab = hf.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=True)
    max_requests = max(args.concurrency)
    engines = {
        "graphs": engine_for(ours, pg, args, max_requests),
        "eager": engine_for(ours, pg, args, max_requests, enable_cuda_graphs=False),
    }
    if args.unpadded:
        engines["unpadded"] = engine_for(ours, pg, args, max_requests, batch_invariant=False)
    graphs_on = engines["graphs"].graphs is not None
    result.update(
        model=kind,
        parameters=sum(p.numel() for p in ours.parameters()),
        weights_bytes=sum(p.numel() * p.element_size() for p in ours.parameters()),
        cuda_graphs=graphs_on,
        cuda_graphs_blocker=engines["graphs"].cuda_graphs_blocker,
        step_buckets=engines["eager"].buckets.sizes if engines["eager"].buckets is not None else None,
        overlap_steps=engines["graphs"].overlap_steps,
    )
    step_graphs = engines["graphs"].graphs
    captured = step_graphs is not None and step_graphs.capturing
    result["cuda_graphs_captured_buckets"] = step_graphs.buckets if captured else []
    result["cuda_graphs_captured_mixed_buckets"] = step_graphs.mixed_buckets if captured else []
    result["mixed_step_graphs_blocker"] = engines["graphs"].mixed_step_graphs_blocker
    mixed = (
        f"mixed-step graphs for token buckets {step_graphs.mixed_buckets}"
        if captured and step_graphs.mixed_buckets
        else f"no mixed-step graphs ({engines['graphs'].mixed_step_graphs_blocker})"
    )
    print(
        f"{kind}: decode CUDA graphs captured for buckets {step_graphs.buckets}, {mixed}"
        if captured
        else f"{kind}: decode CUDA graphs not captured ({engines['graphs'].cuda_graphs_blocker or 'not on CUDA'})",
        f"(engines ready at {time.monotonic() - started:.0f} s)",
        flush=True,
    )
    warmup = dataclasses.replace(params, max_tokens=8)
    for mode, engine in engines.items():  # compile Triton kernels, settle the allocator
        drive(engine, make_prompts(max_requests, args.prompt_tokens, vocab, seed=99), warmup, args.run_budget_s)
        print(f"{kind}: {mode} engine warmed up at {time.monotonic() - started:.0f} s", flush=True)
    static_ok = kind == "gpt"  # NemotronH keeps its own hybrid cache: no static cache
    for concurrency in args.concurrency:
        if _model_time_left_s(args) < 0:
            result["rows"].append(dict(concurrency=concurrency, skipped="--model-budget-s spent"))
            print(f"{kind:6s} c={concurrency:<4d} | skipped: --model-budget-s spent", flush=True)
            continue
        prompts = make_prompts(concurrency, args.prompt_tokens, vocab, seed=concurrency)
        row = dict(concurrency=concurrency, trials=args.trials)
        modes = {mode: engine for mode, engine in engines.items() if mode != "graphs" or graphs_on}
        for engine in modes.values():
            drive(engine, prompts, warmup, args.run_budget_s)  # the shapes of this concurrency
        hf_calls = {"hf_dynamic": hf_generator(hf, prompts, args.new_tokens, device, args.run_budget_s)}
        if static_ok and concurrency in args.hf_static_concurrency:
            hf_calls["hf_static"] = hf_generator(
                hf, prompts, args.new_tokens, device, args.run_budget_s, cache_implementation="static"
            )
        trials = {name: [] for name in [*modes, *hf_calls]}
        for _ in range(args.trials):  # alternating, so that clock and load drift hit every side alike
            for mode, engine in modes.items():
                trials[mode].append(drive(engine, prompts, params, args.run_budget_s))
            for name, timed in hf_calls.items():
                trials[name].append(timed())
        runs = {mode: median_run(trials[mode]) for mode in modes}
        hf_runs = {name: median_run(trials[name]) for name in hf_calls}
        context = args.prompt_tokens + args.new_tokens / 2
        roofline = concurrency / (step_bytes(ours, engines["eager"], concurrency, context) / bandwidth)
        row["roofline_tokens_per_s"] = roofline
        for mode, run in runs.items():
            rate = _rate(concurrency, args, run)
            row[f"ours_{mode}_tokens_per_s"] = rate
            row[f"ours_{mode}_ttft_ms"] = 1e3 * statistics.median(run["first_token_s"])
            row[f"ours_{mode}_roofline_pct"] = None if rate is None else 100 * rate / roofline
            decode_steps = max(run["steps"] - 1, 1)
            row[f"ours_{mode}_ms_per_step"] = 1e3 * (run["elapsed_s"] - min(run["first_token_s"])) / decode_steps
        if "unpadded" in runs:
            default_rate = _rate(concurrency, args, runs.get("graphs", runs["eager"]))
            row["default_over_unpadded"] = _ratio(default_rate, _rate(concurrency, args, runs["unpadded"]))
        if "graphs" in runs:
            graphs, eager = runs["graphs"], runs["eager"]
            row["graph_vs_eager_identical_tokens"] = graphs["tokens"] == eager["tokens"]
            row["graph_vs_eager_identical_log_probs"] = graphs["log_probs"] == eager["log_probs"]
            row["ours_graphs_graph_steps"] = graphs["graph_steps"]
            row["ours_graphs_graph_mixed_steps"] = graphs["graph_mixed_steps"]
        best = runs.get("graphs", runs["eager"])
        for name, run in hf_runs.items():
            rate = _rate(concurrency, args, run)
            row[f"{name}_tokens_per_s"] = rate
            ours_rate = _rate(concurrency, args, best)
            row[f"ours_over_{name}"] = None if rate is None or ours_rate is None else ours_rate / rate
            row[f"ours_vs_{name}_identical_tokens"] = sum(
                a == b for a, b in zip(best["tokens"], run["tokens"], strict=True)
            )
        if concurrency == 1:
            weights_read_ms = 1e3 * result["weights_bytes"] / bandwidth
            row["weights_read_ms"] = weights_read_ms
            row["batch1_step_over_weights_read"] = row[f"ours_{'graphs' if graphs_on else 'eager'}_ms_per_step"] / (
                weights_read_ms
            )
        result["rows"].append(row)
        print(_format_row(kind, row), flush=True)
        if args.profile_steps:
            engine = engines["graphs" if graphs_on else "eager"]
            profiled = row["profile"] = profile_decode(engine, prompts, params, args.profile_steps, device)
            print(
                f"{kind:6s} c={concurrency:<4d} | profile of {profiled['steps']} decode steps "
                f"({profiled['graph_steps']} from graphs): {profiled['wall_ms_per_step']:.2f} ms wall, "
                f"{profiled['gpu_busy_ms_per_step']:.2f} ms GPU busy per step "
                f"({100 * profiled['gpu_busy_fraction']:.0f}%), {profiled['kernels_per_step']:.0f} kernels/step; "
                "top: " + ", ".join(f"{k['name'][:40]} {k['ms_per_step']:.3f} ms" for k in profiled["top_kernels"][:5]),
                flush=True,
            )
            prefill = profiled["prefill"]
            print(
                f"{kind:6s} c={concurrency:<4d} | profile of the {prefill['steps']} prefill steps: "
                f"{prefill['wall_ms_per_step']:.2f} ms wall, "
                f"{prefill['gpu_busy_ms_per_step']:.2f} ms GPU busy per step; "
                "top: " + ", ".join(f"{k['name'][:40]} {k['ms_per_step']:.3f} ms" for k in prefill["top_kernels"][:5]),
                flush=True,
            )
            print(
                f"{kind:6s} c={concurrency:<4d} | CUDA runtime calls per step: "
                + ", ".join(f"{c['name']} {c['ms_per_step']:.3f} ms" for c in profiled["cuda_runtime_calls"]),
                flush=True,
            )
            print(
                f"{kind:6s} c={concurrency:<4d} | host per step (median): "
                + ", ".join(f"{label} {ms:.3f} ms" for label, ms in profiled["host_ms_per_step"].items()),
                flush=True,
            )
        args.write_partial()
    del hf, ours, engines
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _model_time_left_s(args) -> float:
    return args.deadline - time.monotonic()


def _fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _format_row(kind: str, row: dict) -> str:
    parts = [f"{kind:6s} c={row['concurrency']:<4d}"]
    for mode in ("graphs", "eager", "unpadded"):
        if f"ours_{mode}_tokens_per_s" in row:
            parts.append(
                f"ours[{mode}] {_fmt(row[f'ours_{mode}_tokens_per_s'])} tok/s "
                f"({_fmt(row[f'ours_{mode}_roofline_pct'], '.1f')}% roofline, "
                f"TTFT {_fmt(row[f'ours_{mode}_ttft_ms'], '.1f')} ms, "
                f"{_fmt(row[f'ours_{mode}_ms_per_step'], '.2f')} ms/step)"
            )
    for name in ("hf_dynamic", "hf_static"):
        if f"{name}_tokens_per_s" in row:
            parts.append(
                f"{name} {_fmt(row[f'{name}_tokens_per_s'])} tok/s (ours/HF {_fmt(row[f'ours_over_{name}'], '.2f')}x)"
            )
    if "default_over_unpadded" in row:
        parts.append(f"default/unpadded {_fmt(row['default_over_unpadded'], '.2f')}x")
    if "graph_vs_eager_identical_tokens" in row:
        parts.append(
            f"graphs==eager tokens {row['graph_vs_eager_identical_tokens']} "
            f"log-probs {row['graph_vs_eager_identical_log_probs']} "
            f"({row['ours_graphs_graph_steps']} graph steps, {row['ours_graphs_graph_mixed_steps']} of them mixed)"
        )
    if "batch1_step_over_weights_read" in row:
        parts.append(f"batch-1 step / weights read {row['batch1_step_over_weights_read']:.2f}x")
    return " | ".join(parts)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,hybrid", help="comma-separated: gpt, hybrid")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 8, 64, 256])
    parser.add_argument(
        "--hf-static-concurrency",
        type=_int_list,
        default=[64],
        help="concurrencies at which HF generate also runs with its static compiled cache (each compiles anew)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-tokens-per-step", type=int, default=2048)
    parser.add_argument("--trials", type=int, default=3, help="alternating timed runs per side (median kept)")
    parser.add_argument("--run-budget-s", type=float, default=30.0, help="a run past this is stopped and reported")
    parser.add_argument(
        "--model-budget-s",
        type=float,
        default=170.0,
        help="a model's rows not started within this many seconds of its start are reported as skipped "
        "(the JSON is written after each row)",
    )
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth copy (>= 1 GiB)")
    parser.add_argument(
        "--unpadded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run ours with batch_invariant=False (graphs where possible), to compare the default mode with it",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="also profile this many decode steps of the default engine at each concurrency (torch.profiler)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models of the same structure (a smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(2)
    parallel_state.initialize_distributed("nccl" if device.type == "cuda" else "gloo")
    pg = parallel_state.initialize_model_parallel()
    num_bytes = int(args.copy_gib * 2**30)
    bandwidth = copy_bandwidth_bytes_per_s(device, num_bytes)
    print(f"copy bandwidth ({args.copy_gib:g} GiB device-to-device, read + write): {bandwidth / 1e9:.0f} GB/s")
    report = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        copy_bandwidth_bytes_per_s=bandwidth,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        models=[],
    )
    args.write_partial = lambda: write_report(report, args.output_json)
    for kind in (k for k in args.models.split(",") if k):
        report["models"].append(dict(model=kind, rows=[]))
        report["models"][-1] = bench_model(kind, args, pg, device, bandwidth, report["models"][-1])
    gpt = next((m for m in report["models"] if m["model"] == "gpt"), None)
    hybrid = next((m for m in report["models"] if m["model"] == "hybrid"), None)
    if gpt and hybrid:
        report["hybrid_over_gpt_decode"] = {
            row["concurrency"]: _ratio(_best_rate(h), _best_rate(row))
            for row, h in zip(gpt["rows"], hybrid["rows"], strict=True)
        }
        print(
            "hybrid / GPT output tok/s: "
            + ", ".join(f"c={c}: {_fmt(r, '.2f')}" for c, r in report["hybrid_over_gpt_decode"].items())
        )
    return finish(report, args.output_json)


def _best_rate(row: dict) -> float | None:
    return row.get("ours_graphs_tokens_per_s") or row.get("ours_eager_tokens_per_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


if __name__ == "__main__":
    sys.exit(main())
