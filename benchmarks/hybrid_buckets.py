"""Hybrid (Mamba + attention) decode in the default batch-invariant mode: steps padded to the step
buckets (the Mamba decode step is row invariant, so every bucket passes the check) vs every step
padded to ``max_tokens_per_step`` (the one bucket hybrid models had before), in the same process,
alternating trials, median output tokens/s and the ratio; the two must give identical tokens and
log-probs. The unpadded mode (``batch_invariant=False``) runs alongside as the speed the default
mode must not fall below (its greedy tokens are compared, its log-probs may differ by rounding).
CUDA graphs are off in all three (eager steps; ``benchmarks/gpu_decode.py`` measures graphs).

    python -m benchmarks.hybrid_buckets [--requests 16] [--new-tokens 24] [--device cpu] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from megatron.core import parallel_state
from megatron.core.benchmark_report import finish
from megatron.core.config import TransformerConfig
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.engines.step_buckets import StepBuckets
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel

PATTERN, VOCAB, MAX_TOKENS_PER_STEP = "M*-M*-M-", 512, 256


def build_model(pg, hidden_size: int, device: torch.device) -> HybridModel:
    config = TransformerConfig(
        num_layers=len(PATTERN),
        hidden_size=hidden_size,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=2 * hidden_size,
        normalization="RMSNorm",
        add_bias_linear=False,
        mamba_num_heads=8,
        mamba_head_dim=hidden_size // 4,
        mamba_num_groups=2,
        mamba_state_dim=16,
        mamba_d_conv=4,
        init_method_std=0.05,
    )
    torch.manual_seed(0)
    model = HybridModel(
        config, get_hybrid_stack_local_spec(), VOCAB, 256, hybrid_layer_pattern=PATTERN, pg_collection=pg
    )
    return model.eval().to(device)


def drive(engine: DynamicInferenceEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Run ``prompts`` to completion: output tokens/s, tokens and log-probs per request."""
    tag = f"{time.perf_counter_ns()}-"
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{index}", prompt, params)
    tokens = {i: [] for i in range(len(prompts))}
    log_probs = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            index = int(out.request_id.removeprefix(tag))
            tokens[index] += out.new_token_ids
            log_probs[index] += out.new_log_probs
    elapsed = time.perf_counter() - started
    return dict(rate=len(prompts) * params.max_tokens / elapsed, tokens=tokens, log_probs=log_probs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    parallel_state.initialize_distributed("nccl" if device.type == "cuda" else "gloo")
    pg = parallel_state.initialize_model_parallel()
    model = build_model(pg, args.hidden_size, device)
    engines = {}
    for mode in ("buckets", "max_padded", "unpadded"):
        engines[mode] = DynamicInferenceEngine(
            model,
            block_size=16,
            num_blocks=args.requests * -(-(args.prompt_tokens + args.new_tokens) // 16) + 8,
            max_requests=args.requests,
            max_tokens_per_step=MAX_TOKENS_PER_STEP,
            max_sequence_length=args.prompt_tokens + args.new_tokens,
            enable_cuda_graphs=False,
            enable_chunked_prefill=True,
            pg_collection=pg,
            batch_invariant=mode != "unpadded",
        )
    engines["max_padded"].buckets = StepBuckets([MAX_TOKENS_PER_STEP])
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, VOCAB, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=True)
    for engine in engines.values():  # warm-up
        drive(engine, prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    rates, last = {mode: [] for mode in engines}, {}
    for _ in range(args.trials):
        for mode, engine in engines.items():
            last[mode] = drive(engine, prompts, params)
            rates[mode].append(last[mode]["rate"])
    report = dict(
        device=str(device),
        requests=args.requests,
        new_tokens=args.new_tokens,
        step_buckets=engines["buckets"].buckets.sizes,
        tokens_per_s={mode: statistics.median(r) for mode, r in rates.items()},
        trials_tokens_per_s=rates,
        identical_tokens=last["buckets"]["tokens"] == last["max_padded"]["tokens"],
        identical_log_probs=last["buckets"]["log_probs"] == last["max_padded"]["log_probs"],
    )
    report["unpadded_identical_tokens"] = last["buckets"]["tokens"] == last["unpadded"]["tokens"]
    for baseline in ("max_padded", "unpadded"):
        report[f"buckets_over_{baseline}"] = report["tokens_per_s"]["buckets"] / report["tokens_per_s"][baseline]
    print(f"step buckets {report['step_buckets']}")
    for mode, rate in report["tokens_per_s"].items():
        print(f"{mode:10s} {rate:8.1f} output tok/s (trials {', '.join(f'{r:.1f}' for r in rates[mode])})")
    print(
        f"buckets / max-padded {report['buckets_over_max_padded']:.2f}x; "
        f"identical tokens {report['identical_tokens']}, log-probs {report['identical_log_probs']}"
    )
    print(
        f"buckets (default mode) / unpadded {report['buckets_over_unpadded']:.2f}x; "
        f"identical greedy tokens {report['unpadded_identical_tokens']}"
    )
    return finish(report, args.output_json, 0 if report["identical_tokens"] and report["identical_log_probs"] else 1)


if __name__ == "__main__":
    sys.exit(main())
