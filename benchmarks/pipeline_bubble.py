#!/usr/bin/env python3
"""Wall clock of 1F1B (PP4) against the interleaved schedule (PP4 x V2) on CPU, side by side.

A toy pipeline of ``--num-layers`` tanh(linear) layers, each padded with a sleep of
``--sleep-ms`` in forward and twice that in backward, so compute has a known cost and
dominates (the machine's cores are not what is measured). The same four gloo processes run
both schedules over the same layers and micro-batches; trials alternate between them (which
goes first alternates too) and the median of each side is compared with the prediction of the
bubble formula: a pipeline of p stages, v virtual stages and m micro-batches of cost t each
takes ``t (m + (p - 1) / v)``, so going from v = 1 to v = 2 should save
``T_pp (1 - (m + (p - 1) / v) / (m + p - 1))``.

    python benchmarks/pipeline_bubble.py [--microbatches 8] [--sleep-ms 40] [--trials 5] [--json out.json]

Prints each side's median seconds, the measured idle fraction (from the schedule's timeline)
next to the formula's, and the achieved share of the predicted reduction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core.benchmark_report import finish

PP, VP = 4, 2
HIDDEN, SEQ, MBS = 8, 4, 2


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``sleep_s`` in forward and ``2 sleep_s`` in backward."""

    @staticmethod
    def forward(ctx, x, sleep_s):
        ctx.sleep_s = sleep_s
        if sleep_s:
            time.sleep(sleep_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sleep_s:
            time.sleep(2 * ctx.sleep_s)
        return grad, None


class SleepPaddedLinear(torch.nn.Module):
    """tanh(linear(x)) padded with a sleep (forward ``sleep_s``, backward ``2 sleep_s``)."""

    def __init__(self, linear: torch.nn.Linear, sleep_s: float):
        super().__init__()
        self.linear, self.sleep_s = linear, sleep_s

    def forward(self, x):
        return _Sleep.apply(torch.tanh(self.linear(x)), self.sleep_s)


class ToyStage(torch.nn.Module):
    """One (virtual) pipeline stage of sleep-padded layers; the first reads its batch itself,
    the others the tensor given to ``set_input_tensor``."""

    def __init__(self, layers, first: bool, sleep_s: float = 0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(SleepPaddedLinear(layer, sleep_s) for layer in layers)
        self.first = first
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.first else self.input_tensor
        for layer in self.layers:
            h = layer(h)
        return h


def toy_forward_step(data_iterator, model):
    """A schedule's forward_step_func for ToyStage: mean squared error against the target."""
    x, target = next(data_iterator)
    out = model(x)

    def loss_func(output):
        loss = ((output - target) ** 2).mean()
        return loss, {"loss": loss.detach().item()}

    return out, loss_func


def _one_run(pgc, vp, layers, batches, sleep_s):
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.pipeline_parallel.timeline import PipelineTimeline

    rank = pgc.rank("pp")
    per_chunk = len(layers) // (PP * vp)
    chunks = []
    for v in range(vp):
        first = (v * PP + rank) * per_chunk
        chunks.append(ToyStage(layers[first : first + per_chunk], first == 0, sleep_s))
    timeline = PipelineTimeline()
    schedule = get_forward_backward_func(PP, vp if vp > 1 else None)
    iterators = [iter(batches) for _ in chunks]
    schedule(
        forward_step_func=toy_forward_step,
        data_iterator=iterators if vp > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(batches),
        tensor_shape=(SEQ, MBS, HIDDEN),
        pg_collection=pgc,
        timeline=timeline,
    )
    return timeline.total_s, timeline.idle_fraction


def _rank_main(rank, store_path, opts, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.FileStore(store_path, PP), rank=rank, world_size=PP)
    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(opts.num_layers)]
    batches = [(torch.randn(SEQ, MBS, HIDDEN), torch.randn(SEQ, MBS, HIDDEN)) for _ in range(opts.microbatches)]
    sleep_s = opts.sleep_ms / 1000
    _one_run(pgc, VP, layers, batches, 0.0)  # warm up both paths (connections, autograd)
    _one_run(pgc, 1, layers, batches, 0.0)
    measured = {1: [], VP: []}
    for trial in range(opts.trials):
        for vp in (1, VP) if trial % 2 == 0 else (VP, 1):
            measured[vp].append(_one_run(pgc, vp, layers, batches, sleep_s))
    if rank == 0:
        results.put(measured)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run(opts) -> dict:
    """Run both schedules on four local gloo ranks; returns the summary that main prints."""
    if opts.num_layers % (PP * VP):
        raise SystemExit(f"--num-layers must be a multiple of {PP * VP}")
    if opts.microbatches % PP:
        raise SystemExit(f"--microbatches must be a multiple of {PP}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, os.path.join(tmp, "store"), opts, results)) for r in range(PP)]
        for proc in procs:
            proc.start()
        measured = results.get(timeout=600)
        for proc in procs:
            proc.join()
    m = opts.microbatches
    pp_s = statistics.median(total for total, _ in measured[1])
    vpp_s = statistics.median(total for total, _ in measured[VP])
    predicted_vpp_s = pp_s * (m + (PP - 1) / VP) / (m + PP - 1)
    return {
        "pp": PP,
        "vp": VP,
        "microbatches": m,
        "sleep_ms": opts.sleep_ms,
        "trials": opts.trials,
        "pp4_s": pp_s,
        "pp4_vp2_s": vpp_s,
        "predicted_pp4_vp2_s": predicted_vpp_s,
        "idle_fraction_pp4": statistics.median(idle for _, idle in measured[1]),
        "idle_fraction_pp4_vp2": statistics.median(idle for _, idle in measured[VP]),
        "formula_idle_pp4": (PP - 1) / (m + PP - 1),
        "formula_idle_pp4_vp2": (PP - 1) / (VP * m + PP - 1),
        "achieved_share_of_predicted_reduction": (pp_s - vpp_s) / (pp_s - predicted_vpp_s),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--sleep-ms", type=float, default=40.0, help="forward sleep per layer (backward: twice)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the summary here")
    opts = parser.parse_args(argv)
    summary = run(opts)
    print(
        f"PP4: {summary['pp4_s']:.3f} s   PP4xV2: {summary['pp4_vp2_s']:.3f} s   "
        f"(predicted {summary['predicted_pp4_vp2_s']:.3f} s; median of {opts.trials} alternating trials, "
        f"{opts.microbatches} micro-batches, {opts.num_layers} layers, {opts.sleep_ms:g} ms forward sleep per layer)"
    )
    print(
        f"idle fraction from the timeline: PP4 {summary['idle_fraction_pp4']:.3f} "
        f"(formula {summary['formula_idle_pp4']:.3f}), PP4xV2 {summary['idle_fraction_pp4_vp2']:.3f} "
        f"(formula {summary['formula_idle_pp4_vp2']:.3f})"
    )
    print(
        f"ratio PP4xV2 / PP4: {summary['pp4_vp2_s'] / summary['pp4_s']:.3f}; "
        f"achieved share of the predicted reduction: {100 * summary['achieved_share_of_predicted_reduction']:.0f}%"
    )
    return finish(summary, opts.json)


if __name__ == "__main__":
    sys.exit(main())
