#!/usr/bin/env python3
"""Train-step time with overlapped communication on vs off, side by side in one process.

Three Trainers of the same GPT-2-style model (LayerNorm, GeLU, learned positions) start from
the same weights and read the same batches: one with the plain flags, one adding
``--overlap-grad-reduce`` (and, with ``--distributed-optimizer``, ``--overlap-param-gather``),
and a control with the plain flags again (the A/A run: how far two identical sides differ in
time, and in loss where the device's kernels are not deterministic, e.g. CUDA's embedding
backward). Trials rotate the sides (which goes first rotates too); each trial times ``--steps``
train steps, and the median step time of each side gives the ratios.

    # one GPU (DP 1: nothing to reduce, so the overlap machinery must cost nothing)
    python benchmarks/grad_overlap.py --json grad_overlap.json
    # several GPUs (DP = world size), distributed optimizer
    torchrun --nproc-per-node 8 benchmarks/grad_overlap.py --distributed-optimizer --json grad_overlap.json
    # CPU smoke run (gloo)
    python benchmarks/grad_overlap.py --hidden-size 64 --num-layers 2 --seq-length 64 --micro-batch-size 2

Prints each side's median (and fastest and slowest trial's) ms/step, the ratios on/off (<= 1
is good) and control/off (the noise floor), and whether the loss curves of on and of the
control are identical to off's; ``--json`` writes the same numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron.core.benchmark_report import finish

SIDES = ("off", "on", "control")


def gpt_flags(opts, train_iters: int) -> list[str]:
    flags = [
        *("--num-layers", str(opts.num_layers), "--hidden-size", str(opts.hidden_size)),
        *("--num-attention-heads", str(opts.num_attention_heads), "--seq-length", str(opts.seq_length)),
        *("--micro-batch-size", str(opts.micro_batch_size), "--train-iters", str(train_iters)),
        *("--lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0"),
        *("--mock-data", "--vocab-size", str(opts.vocab_size), "--log-interval", "1000000000"),
        *("--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--eval-iters", "0"),
    ]
    if opts.global_batch_size is not None:
        flags += ["--global-batch-size", str(opts.global_batch_size)]
    if opts.ddp_bucket_size is not None:
        flags += ["--ddp-bucket-size", str(opts.ddp_bucket_size)]
    if torch.cuda.is_available():
        flags += ["--bf16"]
    if opts.distributed_optimizer:
        flags += ["--use-distributed-optimizer"]
    return flags


def build_trainers(opts, train_iters: int):
    """The overlap-off, overlap-on and control (off again) Trainers on this world, from the same seed."""
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron, set_random_seeds
    from megatron.training.training import Trainer

    off = gpt_flags(opts, train_iters)
    on = off + ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if opts.distributed_optimizer else [])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = [parse_args(flags, model_family="gpt", world_size=world_size) for flags in (off, on, off)]
    pgc = initialize_megatron(args[0])
    trainers = []
    for a in args:
        set_random_seeds(a.seed, pgc)
        trainers.append(Trainer(a, pgc))
    return trainers


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare(opts) -> dict:
    train_iters = opts.trials * opts.steps + opts.warmup
    trainers = build_trainers(opts, train_iters)
    iterators = [t.data_iterator(t.train_ds, 0) for t in trainers]
    sides = range(len(trainers))
    losses: list[list[float]] = [[] for _ in sides]
    for _ in range(opts.warmup):
        for side in sides:
            losses[side].append(trainers[side].train_step(iterators[side])[0])
    times: list[list[float]] = [[] for _ in sides]
    for trial in range(opts.trials):
        for side in [(trial + offset) % len(trainers) for offset in sides]:
            _sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(opts.steps):
                losses[side].append(trainers[side].train_step(iterators[side])[0])
            _sync()
            times[side].append((time.perf_counter() - start) / opts.steps)
    # Every rank must agree on the times: take the slowest rank's (the step ends for all then).
    device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces device tensors
    per_side = [[statistics.median(t), min(t), max(t)] for t in times]
    slowest = torch.tensor(per_side, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    (off_ms, on_ms, control_ms), fastest, slowest_trial = (1000 * slowest[:, column] for column in range(3))
    args = trainers[0].args
    return {
        "world_size": dist.get_world_size(),
        "data_parallel_size": args.data_parallel_size,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "distributed_optimizer": opts.distributed_optimizer,
        "model": {
            "num_layers": opts.num_layers,
            "hidden_size": opts.hidden_size,
            "seq_length": opts.seq_length,
            "micro_batch_size": opts.micro_batch_size,
            "global_batch_size": args.global_batch_size,
            "num_buckets": [sum(len(b.buckets) for b in t.model.param_and_grad_buffers) for t in trainers],
        },
        "steps_per_trial": opts.steps,
        "trials": opts.trials,
        "off_ms_per_step": float(off_ms),
        "on_ms_per_step": float(on_ms),
        "control_ms_per_step": float(control_ms),
        "fastest_trial_ms_per_step": dict(zip(SIDES, fastest.tolist(), strict=True)),
        "slowest_trial_ms_per_step": dict(zip(SIDES, slowest_trial.tolist(), strict=True)),
        "ratio_on_over_off": float(on_ms / off_ms),
        "ratio_control_over_off": float(control_ms / off_ms),
        "losses_identical": losses[0] == losses[1],
        "max_abs_loss_difference": _max_difference(losses[0], losses[1]),
        "control_losses_identical": losses[0] == losses[2],
        "control_max_abs_loss_difference": _max_difference(losses[0], losses[2]),
    }


def _max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--num-layers", type=int, default=12 if gpu else 2)
    parser.add_argument("--hidden-size", type=int, default=1024 if gpu else 64)
    parser.add_argument("--num-attention-heads", type=int, default=16 if gpu else 4)
    parser.add_argument("--seq-length", type=int, default=2048 if gpu else 64)
    parser.add_argument("--micro-batch-size", type=int, default=4 if gpu else 2)
    parser.add_argument("--global-batch-size", type=int, default=None, help="default: one micro-batch per rank")
    parser.add_argument("--vocab-size", type=int, default=50304 if gpu else 512)
    parser.add_argument("--ddp-bucket-size", type=int, default=None, help="default: Megatron's")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--steps", type=int, default=5, help="timed train steps per trial")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--json", type=str, default=None, metavar="PATH")
    opts = parser.parse_args(argv)
    result = compare(opts)
    if dist.get_rank() == 0:
        print(
            f"{result['device']}, world {result['world_size']} (DP {result['data_parallel_size']}), "
            f"buckets {result['model']['num_buckets'][0]}"
        )
        for side in SIDES:
            print(
                f"overlap {side:<8}: {result[f'{side}_ms_per_step']:.2f} ms/step (trials "
                f"{result['fastest_trial_ms_per_step'][side]:.2f}-{result['slowest_trial_ms_per_step'][side]:.2f})"
            )
        print(
            f"ratio on/off: {result['ratio_on_over_off']:.3f} "
            f"(control/off, the same flags twice: {result['ratio_control_over_off']:.3f})"
        )
        print(
            f"losses identical: {result['losses_identical']} (max diff {result['max_abs_loss_difference']:.3g}); "
            f"control: {result['control_losses_identical']} (max diff {result['control_max_abs_loss_difference']:.3g})"
        )
    return finish(result, opts.json)


if __name__ == "__main__":
    sys.exit(main())
