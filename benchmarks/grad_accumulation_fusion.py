#!/usr/bin/env python3
"""Train-step time with gradient accumulation fusion on vs off, side by side in one process.

One Trainer of a ``benchmarks/gpu_train.py`` configuration (default gpt2: 1.32B, bf16, seq 2048,
micro-batch 8) is stepped with the linear layers' wgrad GEMMs accumulating straight into DDP's
fp32 ``main_grad`` ("fused", the default) and with ``--no-gradient-accumulation-fusion``'s path
("unfused": a bf16 weight gradient per linear, added by DDP's hook). The switch is the model
config's ``gradient_accumulation_fusion``, read at every forward, so both sides run the same model
(trials alternate; each side's median step time gives the ratio). Before timing, one micro-batch's
gradients on the same weights are compared between the sides; after timing, one profiled step per
side reports the CUDA time of the fp32 ``add`` kernels DDP's hook runs and the top kernels.

    python -m benchmarks.grad_accumulation_fusion --json grad_accumulation_fusion.json
    # CPU smoke run (tiny model; the fused path forced on CPU, fp32)
    python -m benchmarks.grad_accumulation_fusion --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from benchmarks.gpu_train import CONFIGS, common_flags
from megatron.core.benchmark_report import finish

TINY = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2"),
    *("--global-batch-size", "2", "--vocab-size", "512", "--distributed-backend", "gloo"),
]  # fmt: skip


def build_trainer(name: str, tiny: bool):
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import Trainer

    flags = common_flags() + CONFIGS[name]["flags"]
    if tiny:
        flags = [f for f in flags if f != "--bf16"] + TINY  # later flags win
    args = parse_args(flags, model_family=CONFIGS[name]["family"], world_size=1)
    return Trainer(args, initialize_megatron(args))


def fusion_switch(module: torch.nn.Module):
    """``switch(on)`` sets ``gradient_accumulation_fusion`` on every config the model's modules read."""
    configs = {id(m.config): m.config for m in module.modules() if hasattr(m, "config")}

    def switch(on: bool) -> None:
        for config in configs.values():
            config.gradient_accumulation_fusion = on

    return switch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gradient_difference(trainer, switch) -> dict:
    """One micro-batch's forward/backward on the same weights and batch, fused and unfused: the
    relative L2 distance of all main_grads and the worst parameter's."""
    from megatron.training.training import forward_step

    grads = {}
    for on in (True, False):
        switch(on)
        trainer.model.zero_grad_buffer()
        output, loss_func = forward_step(trainer.data_iterator(trainer.train_ds, 0), trainer.model)
        loss_func(output)[0].backward()
        grads[on] = [p.main_grad.clone() for p in trainer.model.module.parameters()]
    trainer.model.zero_grad_buffer()
    pairs = list(zip(grads[True], grads[False], strict=True))
    per_param = [float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in pairs]
    total = sum(float((a - b).norm()) ** 2 for a, b in pairs) ** 0.5
    scale = sum(float(b.norm()) ** 2 for _, b in pairs) ** 0.5
    return {"relative_l2": total / scale, "worst_param_relative_l2": max(per_param)}


def profile_step(step) -> dict:
    """CUDA time of one step: the fp32 add kernels (DDP's hook adding bf16 grads to main_grad) and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync()
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.device_time_total)
    adds = [e for e in events if "CUDAFunctor_add<float>" in e.key]
    return {
        "total_kernel_ms": round(sum(e.device_time_total for e in events) / 1000, 2),
        "float_add_kernels": {
            "count": sum(e.count for e in adds),
            "ms": round(sum(e.device_time_total for e in adds) / 1000, 3),
        },
        "top_kernels": [[e.key[:100], round(e.device_time_total / 1000, 3), e.count] for e in events[:12]],
    }


def compare(opts) -> dict:
    trainer = build_trainer(opts.config, opts.tiny)
    switch = fusion_switch(trainer.model.module)
    iterator = trainer.data_iterator(trainer.train_ds, 0)
    sides = {"fused": True, "unfused": False}

    def stepper(on):
        def step():
            switch(on)
            return trainer.train_step(iterator)[0]

        return step

    steps = {side: stepper(on) for side, on in sides.items()}
    report = {"config": opts.config, "tiny": opts.tiny, "device": str(trainer.device)}
    report["gradients_fused_vs_unfused"] = gradient_difference(trainer, switch)
    losses = {side: [steps[side]() for _ in range(opts.warmup)] for side in sides}
    times = {side: [] for side in sides}
    for trial in range(opts.trials):
        for side in sides if trial % 2 == 0 else reversed(sides):
            _sync()
            start = time.perf_counter()
            for _ in range(opts.steps):
                losses[side].append(steps[side]())
            _sync()
            times[side].append((time.perf_counter() - start) / opts.steps)
    args = trainer.args
    tokens = args.seq_length * args.global_batch_size
    for side in sides:
        median = statistics.median(times[side])
        report[side] = {
            "step_ms": round(1000 * median, 2),
            "trial_step_ms": [round(1000 * t, 2) for t in times[side]],
            "tflops": round(tokens / median * trainer.flops_per_token / 1e12, 1),
            "last_loss": round(losses[side][-1], 4),
        }
    report["speedup_fused_over_unfused"] = round(report["unfused"]["step_ms"] / report["fused"]["step_ms"], 4)
    if torch.cuda.is_available():
        report["profile"] = {side: profile_step(steps[side]) for side in sides}
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=list(CONFIGS), default="gpt2")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (gloo), the fused path forced there")
    parser.add_argument("--steps", type=int, default=2, help="timed train steps per trial")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--json", default=None, metavar="PATH")
    opts = parser.parse_args(argv)
    if not opts.tiny and not torch.cuda.is_available():
        print("grad_accumulation_fusion: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    from megatron.core.distributed.main_grad import fusion_devices

    with fusion_devices("cpu", "cuda") if opts.tiny else contextlib.nullcontext():
        report = compare(opts)
    for side in ("fused", "unfused"):
        print(f"{side:8s}: {report[side]['step_ms']:9.2f} ms/step {report[side]['tflops']:7.1f} TFLOP/s")
    print(f"speedup fused/unfused: {report['speedup_fused_over_unfused']:.3f}")
    print(f"gradients fused vs unfused: {report['gradients_fused_vs_unfused']}")
    for side, prof in report.get("profile", {}).items():
        print(f"{side:8s}: fp32 add kernels {prof['float_add_kernels']}, all kernels {prof['total_kernel_ms']} ms")
    return finish(report, opts.json)


if __name__ == "__main__":
    sys.exit(main())
