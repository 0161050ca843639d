#!/usr/bin/env python3
"""MoE training on one GPU through our Trainer, and our grouped expert GEMM against dense GEMMs.

    python benchmarks/moe_gpu.py [--steps 50] [--output-json out.json]    # one H200, bf16
    python benchmarks/moe_gpu.py --tiny [--output-json out.json]          # CPU, seconds

Model (``SHAPES["gpu"]``; bf16, mock data, AdamW, grad clipping 1.0, no dropout): a GPT of 14
layers, hidden 2048, 16 heads in 4 query groups, RMSNorm, RoPE, untied embeddings (vocab
50304), every MLP an MoE of 8 SwiGLU experts of ffn 4096, top-2, dropless (alltoall
dispatcher), aux loss 1e-2; seq 2048, micro-batch 4. That is about 0.95B active parameters per
token (top-2 of 8 experts, attention, router, output layer; embeddings excluded) and 3.2B in
all (about 58 GB of weights, grads and Adam states).

Training runs ``Trainer.train`` as ``megatron-pretrain-gpt`` does (``--log-interval 10``: the
log line prints loss, step time, TFLOP/s and the load-balancing loss every 10 steps); TFLOP/s
are by the shared formula (:func:`megatron.training.training.count_flops_per_token`, counting
the top-k experts a token meets). The GEMM microbenchmark times the experts' two GEMMs at the
training step's shapes (``seq * micro_batch * topk`` routed rows, balanced over the experts)
three ways, in alternating trials (median): ours (:func:`grouped_gemm`, ``torch._grouped_mm``
on the H200, the loop elsewhere), one dense ``torch.matmul`` of the same total M x K x N (the
FLOPs of the grouped GEMM in one call), and the loop of per-expert matmuls (the reference).
Exits with status 2 where CUDA is missing (without --tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from megatron.core.benchmark_report import finish

SHAPES = {
    "gpu": dict(
        layers=14, hidden=2048, heads=16, groups=4, experts=8, topk=2, ffn=4096, seq=2048, micro_batch=4, vocab=50304
    ),
    "tiny": dict(layers=2, hidden=64, heads=4, groups=2, experts=4, topk=2, ffn=64, seq=32, micro_batch=2, vocab=128),
}


def training_flags(shape: dict, steps: int, metrics_jsonl: str, gpu: bool) -> list[str]:
    """``megatron-pretrain-gpt`` flags of the benchmark model (see the module docstring)."""
    s = shape
    flags = [
        "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
        "--num-attention-heads", str(s["heads"]), "--group-query-attention", "--num-query-groups", str(s["groups"]),
        "--ffn-hidden-size", str(s["ffn"]), "--num-experts", str(s["experts"]), "--moe-router-topk", str(s["topk"]),
        "--moe-ffn-hidden-size", str(s["ffn"]), "--moe-token-dispatcher-type", "alltoall",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights",
        "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]),
        "--micro-batch-size", str(s["micro_batch"]), "--global-batch-size", str(s["micro_batch"]),
        "--train-iters", str(steps), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", str(max(1, steps // 10)),
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.01",
        "--mock-data", "--vocab-size", str(s["vocab"]), "--eval-iters", "0",
        "--log-interval", "10" if steps >= 20 else "5", "--metrics-jsonl", metrics_jsonl,
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--distributed-backend", "nccl" if gpu else "gloo",
    ]  # fmt: skip
    return flags + (["--bf16"] if gpu else [])


def parameter_counts(model: torch.nn.Module, topk: int) -> dict[str, int]:
    """All parameters, and those one token meets (top-k of each layer's experts)."""
    total = active = 0
    for param in model.parameters():
        total += param.numel()
        active += param[0].numel() * topk if getattr(param, "is_expert", False) else param.numel()
    embedding = model.embedding.word_embeddings.weight.numel()
    return {"total": total, "active": active, "active_without_embeddings": active - embedding}


def train(shape: dict, steps: int, gpu: bool) -> dict:
    """``steps`` steps of ``Trainer.train``; its records every --log-interval steps."""
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        args = parse_args(training_flags(shape, steps, metrics, gpu), model_family="gpt", world_size=1)
        trainer = Trainer(args, initialize_megatron(args))
        counts = parameter_counts(trainer.model_chunks[0].module, shape["topk"])
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        with open(metrics, encoding="utf-8") as f:
            records = [r for r in map(json.loads, f) if r["type"] == "train"]
    steady = records[1:] or records  # the first interval includes warm-up and allocator growth
    losses = [r["lm loss"] for r in records]
    return {
        "parameters": counts,
        "flops_per_token": trainer.flops_per_token,
        "log": [
            {
                "iteration": r["iteration"],
                "loss": r["lm loss"],
                "load_balancing_loss": r.get("load_balancing_loss"),
                "step_ms": r["elapsed_ms_per_iteration"],
                "tflops": r["tflops"],
            }
            for r in records
        ],
        "steps": records[-1]["iteration"],
        "step_ms": statistics.median(r["elapsed_ms_per_iteration"] for r in steady),
        "tflops": statistics.median(r["tflops"] for r in steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "loss_fell": losses[-1] < losses[0],
        "wall_s": round(wall, 1),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if gpu else None,
    }


def _timed(fn, iters: int, gpu: bool) -> float:
    """Mean seconds per call of ``fn`` (CUDA-synchronized on the GPU)."""
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def gemm_microbenchmark(shape: dict, gpu: bool, trials: int, iters: int) -> dict:
    """TFLOP/s of the experts' fc1 (``hidden -> 2 ffn``) and fc2 (``ffn -> hidden``) GEMMs:
    ours (grouped), one dense matmul of the same total shape, and the per-expert loop."""
    from megatron.core.transformer.moe.experts import grouped_gemm, grouped_gemm_reference, grouped_gemm_supported

    device, dtype = (torch.device("cuda"), torch.bfloat16) if gpu else (torch.device("cpu"), torch.float32)
    experts, hidden, ffn = shape["experts"], shape["hidden"], shape["ffn"]
    rows = shape["seq"] * shape["micro_batch"] * shape["topk"]
    counts = torch.full((experts,), rows // experts, dtype=torch.int64, device=device)
    rows = int(counts.sum())
    generator = torch.Generator(device=device).manual_seed(0)
    report = {"rows": rows, "experts": experts, "dtype": str(dtype).removeprefix("torch.")}
    for name, k, m in (("fc1", hidden, 2 * ffn), ("fc2", ffn, hidden)):
        x = torch.randn(rows, k, device=device, dtype=dtype, generator=generator)
        weights = torch.randn(experts, k, m, device=device, dtype=dtype, generator=generator) / k**0.5
        dense_weight = weights[0].contiguous()
        variants = {
            "grouped": lambda x=x, w=weights: grouped_gemm(x, w, counts),
            "dense": lambda x=x, w=dense_weight: torch.matmul(x, w),
            "loop": lambda x=x, w=weights: grouped_gemm_reference(x, w, counts),
        }
        torch.testing.assert_close(variants["grouped"](), variants["loop"](), rtol=2e-2, atol=2e-2)
        for fn in variants.values():  # warm-up
            _timed(fn, 1, gpu)
        times = {variant: [] for variant in variants}
        for _ in range(trials):
            for variant, fn in variants.items():
                times[variant].append(_timed(fn, iters, gpu))
        flops = 2.0 * rows * k * m
        tflops = {variant: flops / statistics.median(t) / 1e12 for variant, t in times.items()}
        report[name] = {
            "shape": f"[{rows}, {k}] x {experts} x [{k}, {m}]",
            "tflops": {variant: round(value, 4) for variant, value in tflops.items()},
            "grouped_over_dense": round(tflops["grouped"] / tflops["dense"], 3),
            "grouped_over_loop": round(tflops["grouped"] / tflops["loop"], 3),
        }
    report["grouped_path"] = "torch._grouped_mm" if grouped_gemm_supported(x) else "loop"
    return report


def run(opts) -> dict:
    gpu = not opts.tiny
    shape = dict(SHAPES["tiny" if opts.tiny else "gpu"])
    shape["micro_batch"] = opts.micro_batch_size or shape["micro_batch"]
    report = {"shape": shape, "options": vars(opts)}
    if gpu:
        props = torch.cuda.get_device_properties(0)
        report["environment"] = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda}
    report["train"] = train(shape, opts.steps, gpu)
    report["gemm"] = gemm_microbenchmark(shape, gpu, opts.trials, opts.iters)
    return report


def _print_summary(report: dict) -> None:
    train_report, gemm = report["train"], report["gemm"]
    params = train_report["parameters"]
    print(
        f"model: {params['active_without_embeddings'] / 1e6:.1f}M active parameters (without embeddings), "
        f"{params['total'] / 1e6:.1f}M in all"
    )
    for entry in train_report["log"]:
        print(
            f"step {entry['iteration']:4d}: loss {entry['loss']:.4f} | load_balancing_loss "
            f"{entry['load_balancing_loss']:.4f} | step {entry['step_ms']:.1f} ms | {entry['tflops']:.4g} TFLOP/s"
        )
    print(
        f"train: {train_report['steps']} steps, median step {train_report['step_ms']:.1f} ms, "
        f"{train_report['tflops']:.4g} TFLOP/s, {train_report['tokens_per_s']:.0f} tokens/s, "
        f"loss fell: {train_report['loss_fell']}, peak memory {train_report['peak_memory_gb']} GB"
    )
    for name in ("fc1", "fc2"):
        g = gemm[name]
        print(
            f"gemm {name} {g['shape']}: TFLOP/s {g['tflops']} | grouped/dense {g['grouped_over_dense']} | "
            f"grouped/loop {g['grouped_over_loop']} ({gemm['grouped_path']})"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny shapes on CPU (gloo, fp32), in seconds")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 50; --tiny: 10)")
    parser.add_argument("--trials", type=int, default=None, help="alternating GEMM trials (default 7; --tiny: 3)")
    parser.add_argument("--iters", type=int, default=None, help="GEMM calls per trial (default 20; --tiny: 2)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="override the shape's micro-batch")
    parser.add_argument("--output-json", default=None)
    opts = parser.parse_args(argv)
    opts.steps = opts.steps or (10 if opts.tiny else 50)
    opts.trials = opts.trials or (3 if opts.tiny else 7)
    opts.iters = opts.iters or (2 if opts.tiny else 20)
    if not opts.tiny and not torch.cuda.is_available():
        print("moe_gpu: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    report = run(opts)
    _print_summary(report)
    print(json.dumps({"must_show": {k: report["train"][k] for k in ("steps", "loss_fell", "tflops")}}))
    return finish(report, opts.output_json)


if __name__ == "__main__":
    sys.exit(main())
