"""Cost of the sampling controls per decode step: plain sampling vs sampling after logit bias,
min_tokens and presence / frequency / repetition penalties (the engine's device token counts).

    python -m benchmarks.sampling_controls [--json sampling_controls.json]   (repo root)

A step samples ``--rows`` rows of a ``--vocab`` vocabulary (temperature 0.8, top-p 0.95; half the
rows also min_p), each request having generated ``--generated`` tokens after a prompt of as many.
The anchor (plain ``sample``) and the controlled step run alternately in the same process; the
median over ``--trials`` trials of ``--iters`` steps each is printed with the ratio. Runs on CUDA
when there is one (steps synchronized), else on the CPU. Each controlled step counts one new
token per request, as a decode step does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron.core.benchmark_report import finish
from megatron.core.inference.sampling import SamplingParams, SamplingRows, make_generator, sample
from megatron.core.inference.sampling_controls import ControlRow, TokenCounts, apply_sampling_controls


def _timed(fn, iters: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="sampling_controls.json", help="where to write the results")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--generated", type=int, default=256)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=g) * 3).to(device)
    base = dict(temperature=0.8, top_p=0.95, seed=1)
    plain = [SamplingParams(**base, min_p=0.05 * (i % 2)) for i in range(args.rows)]
    controlled = [
        SamplingParams(
            **base,
            min_p=0.05 * (i % 2),
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            min_tokens=args.generated + 8,
            logit_bias={7: 2.0, 11: -5.0},
        )
        for i in range(args.rows)
    ]
    generators = [make_generator(i) for i in range(args.rows)]
    draws = [args.generated] * args.rows
    prompts = [torch.randint(0, args.vocab, (args.generated,), generator=g).tolist() for _ in range(args.rows)]
    history = [torch.randint(0, args.vocab, (args.generated,), generator=g).tolist() for _ in range(args.rows)]
    counts = TokenCounts(args.rows, args.vocab, device)

    def plain_step():
        sample(logits.clone(), SamplingRows.build(plain, generators, draws, device))

    def controlled_step():
        for tokens in history:  # one new token per request, as a decode step
            tokens.append(len(tokens) % args.vocab)
        rows = [ControlRow(str(i), params, prompts[i], history[i]) for i, params in enumerate(controlled)]
        step_logits = logits.clone()
        apply_sampling_controls(step_logits, rows, counts, eos_token_id=0)
        sample(step_logits, SamplingRows.build(controlled, generators, draws, device))

    samples = {"plain_s": [], "controlled_s": []}
    for _ in range(args.trials):
        samples["plain_s"].append(_timed(plain_step, args.iters, device))
        samples["controlled_s"].append(_timed(controlled_step, args.iters, device))
    result = {name: statistics.median(values) for name, values in samples.items()}
    result.update(
        device=str(device),
        rows=args.rows,
        vocab=args.vocab,
        generated=args.generated,
        ratio_controlled_over_plain=result["controlled_s"] / result["plain_s"],
        count_tensor_bytes=counts.counts.numel() * 4 + counts.seen_in_prompt.numel(),
    )
    finish(result, args.json)
    print(
        f"{device}: {args.rows} rows x {args.vocab} vocab: plain sample {result['plain_s'] * 1e3:.3f} ms/step, "
        f"with controls {result['controlled_s'] * 1e3:.3f} ms/step, ratio {result['ratio_controlled_over_plain']:.2f}"
        f" (count tensors {result['count_tensor_bytes'] / 2**20:.1f} MiB); wrote {args.json}"
    )


if __name__ == "__main__":
    main()
