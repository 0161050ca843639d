"""Dynamic inference engine benchmarks, in one run:

1. Output tokens/s of our engine vs HuggingFace ``generate`` (batched, left-padded, KV cache,
   after a full-size warm-up call) on the same Llama-style model (random weights converted with
   ``hf_mapping``) and prompts, greedy, median of ``--trials`` alternating trials, and the ratio
   ours / HF. Outputs are checked to agree. Ours runs in its default (batch-invariant, padded to
   step buckets) mode and unpadded (``batch_invariant=False``); the ratio default / unpadded is
   printed. With ``--baseline-tree DIR`` (e.g. the main checkout before this change) the same
   measurement also runs on that tree's package, in a subprocess alternating with ours, and the
   ratio now / before is printed (and the tokens compared). Where the time goes: each side's
   time until every request has its first token (HF: a one-token ``generate`` of the same
   prompts, each trial) and the rest.
2. The engine's CPU bookkeeping time per step (scheduling, batch building, sampling
   decisions, output assembly; not the forward) at 64 and 256 concurrent requests.
3. Time to first token of a batch of long prompts with and without private page
   initialization (zeroing fresh KV pages).

On CPU both sides run with ``torch.set_num_threads(--threads)`` (2 by default).

Usage: python benchmarks/inference_throughput.py [--requests 32] [--new-tokens 32]
       [--hidden-size 256] [--num-layers 4] [--device cpu|cuda] [--baseline-tree /work/main]
       [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron.core import parallel_state
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.kernels import linear
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models import hf_mapping
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.parallel_state import initialize_distributed

VOCAB = 512


def build_models(args, pg, device):
    """A random Llama (HF) and the same weights in our GPTModel."""
    torch.manual_seed(0)
    hf = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=args.hidden_size,
                intermediate_size=args.hidden_size * 3,
                num_hidden_layers=args.num_layers,
                num_attention_heads=args.hidden_size // 32,
                num_key_value_heads=max(args.hidden_size // 64, 1),
                max_position_embeddings=args.max_sequence_length,
                tie_word_embeddings=False,
            )
        )
        .eval()
        .to(device)
    )
    config, kwargs = hf_mapping.llama_config_from_hf(hf.config)
    ours = GPTModel(config, get_gpt_layer_local_spec(), pg_collection=pg, **kwargs)
    ours.load_state_dict(hf_mapping.llama_state_dict_from_hf(hf.state_dict(), config), strict=True)
    return hf, ours.eval().to(device)


def make_prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def make_engine(model, pg, args, **overrides) -> DynamicInferenceEngine:
    kwargs = dict(
        block_size=16,
        num_blocks=4096,
        max_requests=512,
        max_tokens_per_step=512,
        max_sequence_length=args.max_sequence_length,
        enable_chunked_prefill=True,
        pg_collection=pg,
    )
    return DynamicInferenceEngine(model, **(kwargs | overrides))


def drive(engine, prompts, params):
    """Run to completion; returns (tokens per request, first-token time per request, elapsed)."""
    started = time.perf_counter()
    tokens, first = {}, {}
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            first.setdefault(out.request_id, time.perf_counter() - started)
    return (
        [tokens[str(i)] for i in range(len(prompts))],
        [first[str(i)] for i in range(len(prompts))],
        time.perf_counter() - started,
    )


@torch.no_grad()
def hf_generate(hf, prompts, new_tokens, device):
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    started = time.perf_counter()
    out = hf.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    elapsed = time.perf_counter() - started
    return out[:, longest:].tolist(), elapsed


def measure_ours(ours, pg, args, prompts, params, batch_invariant: bool) -> tuple[list[list[int]], float, float]:
    """Greedy tokens, seconds, and seconds until every request had its first token, of one run
    of a fresh engine over ``prompts``."""
    tokens, first, seconds = drive(make_engine(ours, pg, args, batch_invariant=batch_invariant), prompts, params)
    return tokens, seconds, max(first)


def _baseline_run(args) -> tuple[list[list[int]], float]:
    """``measure_ours`` of the default mode on ``--baseline-tree``'s package, in a subprocess."""
    command = [sys.executable, os.path.abspath(__file__), "--measure-ours-only", *_shared_argv(args)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline_tree))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # its own world of one
        env.pop(name, None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the baseline run on {args.baseline_tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tokens"], result["seconds"]


def _shared_argv(args) -> list[str]:
    return [
        f"--requests={args.requests}",
        f"--new-tokens={args.new_tokens}",
        f"--hidden-size={args.hidden_size}",
        f"--num-layers={args.num_layers}",
        f"--max-sequence-length={args.max_sequence_length}",
        f"--threads={args.threads}",
        f"--device={args.device}",
    ]


def throughput(hf, ours, pg, args, device) -> dict:
    prompts = make_prompts(args.requests, 16, 128)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    seconds = {"default": [], "unpadded": [], "hf": [], "before": [], "default_first": [], "hf_first": []}
    tokens = {}
    hf_generate(hf, prompts, args.new_tokens, device)  # full-size warm-ups
    for batch_invariant in (True, False):
        measure_ours(ours, pg, args, prompts, params, batch_invariant)
    for _ in range(args.trials):  # alternating, so that load on the shared cores hits every side alike
        tokens["default"], elapsed, first = measure_ours(ours, pg, args, prompts, params, batch_invariant=True)
        seconds["default"].append(elapsed)
        seconds["default_first"].append(first)
        tokens["unpadded"], elapsed, _ = measure_ours(ours, pg, args, prompts, params, batch_invariant=False)
        seconds["unpadded"].append(elapsed)
        tokens["hf"], elapsed = hf_generate(hf, prompts, args.new_tokens, device)
        seconds["hf"].append(elapsed)
        seconds["hf_first"].append(hf_generate(hf, prompts, 1, device)[1])  # the prompts and one token
        if args.baseline_tree:
            tokens["before"], elapsed = _baseline_run(args)
            seconds["before"].append(elapsed)
    median = {name: statistics.median(values) for name, values in seconds.items() if values}
    total = args.requests * args.new_tokens

    def agree(name: str) -> str:
        return f"{sum(a == b for a, b in zip(tokens['default'], tokens[name], strict=True))}/{args.requests}"

    result = dict(
        trials=args.trials,
        ours_tokens_per_s=total / median["default"],
        ours_unpadded_tokens_per_s=total / median["unpadded"],
        hf_tokens_per_s=total / median["hf"],
        ratio=median["hf"] / median["default"],
        default_over_unpadded=median["unpadded"] / median["default"],
        requests_with_identical_greedy_output=agree("hf"),
        unpadded_identical_greedy_output=agree("unpadded"),
        # GEMM shapes the CPU invariant linear runs as row tiles (its probe found one call differs): each
        # costs many small calls per step, so a nonzero count explains a slow default mode.
        tiled_gemm_shapes=sum(not whole for whole in linear._WHOLE_CALL_MATCHES.values()),
        # Where the time goes: until every request has its first token (the prompts), then the rest
        # (decoding); HF computes every prompt at the longest one's length (left padding).
        ours_first_tokens_ms=1e3 * median["default_first"],
        hf_first_tokens_ms=1e3 * median["hf_first"],
        ours_rest_ms=1e3 * (median["default"] - median["default_first"]),
        hf_rest_ms=1e3 * (median["hf"] - median["hf_first"]),
        prompt_tokens=sum(len(p) for p in prompts),
        hf_prompt_positions=len(prompts) * max(len(p) for p in prompts),
    )
    if "before" in median:
        result.update(
            before_tokens_per_s=total / median["before"],
            now_over_before=median["before"] / median["default"],
            before_identical_greedy_output=agree("before"),
        )
    return result


def bookkeeping(model, pg, args, concurrency: int) -> dict:
    engine = make_engine(model, pg, args, max_tokens_per_step=max(512, concurrency), batch_invariant=False)
    drive(engine, make_prompts(concurrency, 4, 12, seed=concurrency), SamplingParams(temperature=0.0, max_tokens=16))
    per_step = engine.step_bookkeeping_s
    return dict(
        concurrency=concurrency,
        steps=len(per_step),
        mean_ms=1e3 * statistics.mean(per_step),
        median_ms=1e3 * statistics.median(per_step),
    )


def time_to_first_token(model, pg, args, device) -> dict:
    prompts = make_prompts(8, args.max_sequence_length // 2, args.max_sequence_length // 2, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    result = {}
    for label, skip in (("with_private_page_init", False), ("without_private_page_init", True)):
        samples = []
        for _ in range(args.repeats):
            engine = make_engine(model, pg, args, max_tokens_per_step=args.max_sequence_length)
            engine.context._skip_private_page_init_for_tests = skip
            _, first, _ = drive(engine, prompts, params)
            samples.append(statistics.mean(first))
        result[f"{label}_ms"] = 1e3 * statistics.median(samples)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--max-sequence-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3, help="alternating throughput trials (the median is kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU (both sides)")
    parser.add_argument("--baseline-tree", default=None, help="a checkout whose engine is measured as 'before'")
    parser.add_argument("--measure-ours-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    initialize_distributed("nccl" if device.type == "cuda" else "gloo")
    pg = parallel_state.initialize_model_parallel()
    hf, ours = build_models(args, pg, device)
    if args.measure_ours_only:  # the --baseline-tree side: one line of JSON
        prompts = make_prompts(args.requests, 16, 128)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
        measure_ours(ours, pg, args, prompts, params, batch_invariant=True)  # warm-up
        tokens, seconds, _ = measure_ours(ours, pg, args, prompts, params, batch_invariant=True)
        print(json.dumps(dict(tokens=tokens, seconds=seconds)))
        torch.distributed.destroy_process_group()
        return 0

    report = {"throughput": throughput(hf, ours, pg, args, device)}
    t = report["throughput"]
    print(
        f"output tokens/s (median of {t['trials']}): ours {t['ours_tokens_per_s']:.1f}, "
        f"HF generate {t['hf_tokens_per_s']:.1f}, ratio ours/HF {t['ratio']:.2f} "
        f"(identical greedy outputs: {t['requests_with_identical_greedy_output']})"
    )
    print(
        f"default (batch-invariant) mode vs unpadded: {t['ours_tokens_per_s']:.1f} vs "
        f"{t['ours_unpadded_tokens_per_s']:.1f} tokens/s, ratio default/unpadded {t['default_over_unpadded']:.2f} "
        f"(identical greedy outputs: {t['unpadded_identical_greedy_output']}; "
        f"GEMM shapes run as row tiles: {t['tiled_gemm_shapes']})"
    )
    print(
        f"where the time goes (medians): until every request has its first token ours {t['ours_first_tokens_ms']:.0f} "
        f"ms, HF {t['hf_first_tokens_ms']:.0f} ms (HF computes {t['hf_prompt_positions']} prompt positions for "
        f"{t['prompt_tokens']} prompt tokens: left padding); the rest (decoding) ours {t['ours_rest_ms']:.0f} ms, "
        f"HF {t['hf_rest_ms']:.0f} ms"
    )
    if "now_over_before" in t:
        print(
            f"this tree vs {args.baseline_tree}: {t['ours_tokens_per_s']:.1f} vs {t['before_tokens_per_s']:.1f} "
            f"tokens/s, ratio now/before {t['now_over_before']:.2f} "
            f"(identical greedy outputs: {t['before_identical_greedy_output']})"
        )
    report["bookkeeping"] = [bookkeeping(ours, pg, args, n) for n in (64, 256)]
    for row in report["bookkeeping"]:
        print(
            f"CPU bookkeeping per step at {row['concurrency']} concurrent requests: mean {row['mean_ms']:.2f} ms, "
            f"median {row['median_ms']:.2f} ms over {row['steps']} steps"
        )
    report["time_to_first_token"] = time_to_first_token(ours, pg, args, device)
    ttft = report["time_to_first_token"]
    print(
        f"time to first token: {ttft['with_private_page_init_ms']:.1f} ms with private page init, "
        f"{ttft['without_private_page_init_ms']:.1f} ms without"
    )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
