"""Step time of a training run while ``--async-save`` writes a checkpoint in the background,
against the same run's step time with no save in flight (and a synchronous run for reference).

    python benchmarks/async_save.py                  # CPU: training on one thread, the writer on another
    python benchmarks/async_save.py --hidden-size 768 --iters 30 --save-interval 10 --json async.json

Runs ``megatron-pretrain-gpt`` in subprocesses with ``OMP_NUM_THREADS=1`` (the training thread
gets one core; the background writer, at nice 19, uses another): ``--repeats`` runs with
``--async-save`` and one without, on a GPT whose full training state (weights and Adam state)
takes several steps to write. Per-iteration times come from ``--metrics-jsonl``. An iteration is
"during a save" when it ran while a background save was in flight: from the one after the save
was started (which also takes the snapshot, reported on its own) to the one the save was
reported complete at. Saves and quiet stretches alternate; each save window is compared with
the quiet steps just before it (median / median), and the ratio printed is the median over all
windows of all runs (1.0: no slowdown), so a machine whose speed drifts during the run still
gives a fair figure. The synchronous save's stall is printed for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from megatron.core.benchmark_report import finish

COMPLETE = re.compile(r"saved checkpoint \S+ \(iteration (\d+), in the background; complete at iteration (\d+)\)")


def _train(flags: list[str], work: str, name: str) -> tuple[dict[int, float], str]:
    """Run one training subprocess; returns (iteration -> elapsed ms, stdout)."""
    metrics = os.path.join(work, f"{name}.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "megatron.training.pretrain_gpt", *flags]
    command += ["--save", os.path.join(work, name), "--metrics-jsonl", metrics, "--log-interval", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"training failed ({done.returncode}):\n{done.stderr[-4000:]}")
    with open(metrics, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(os.path.join(work, name))
    return {r["iteration"]: r["elapsed_ms_per_iteration"] for r in records if r["type"] == "train"}, done.stdout


def save_windows(async_ms: dict[int, float], windows: list[tuple[int, int]], warmup: int) -> list[dict]:
    """Each background save (started after iteration ``start``, reported complete at ``end``)
    against the quiet steps before it: ``quiet`` (after the previous save completed and the
    warm-up, up to ``start``), ``snapshot`` (``start + 1``, which took the copy) and ``busy``
    (``start + 2 .. end``, the steps that ran while the writer wrote). Windows without busy or
    quiet steps are left out (a save that finished within its snapshot step, or the run's last)."""
    result, previous_end = [], warmup
    for start, end in windows:
        quiet = [async_ms[i] for i in range(previous_end + 1, start + 1) if i in async_ms]
        busy = [async_ms[i] for i in range(start + 2, end + 1) if i in async_ms]
        previous_end = max(end, warmup)
        if quiet and busy and start + 1 in async_ms:
            ratio = statistics.median(busy) / statistics.median(quiet)
            result.append(dict(start=start, end=end, quiet_ms=quiet, busy_ms=busy, ratio=ratio))
            result[-1]["snapshot_ms"] = async_ms[start + 1]
    return result


def measure(model_flags: list[str], iters: int, save_interval: int, warmup: int, repeats: int, work: str) -> dict:
    flags = [*model_flags, "--train-iters", str(iters), "--save-interval", str(save_interval)]
    runs = []
    for repeat in range(repeats):
        async_ms, out = _train([*flags, "--async-save"], work, f"async{repeat}")
        windows = [(int(start), int(end)) for start, end in COMPLETE.findall(out)]
        runs.append({"async_ms": async_ms, "windows": save_windows(async_ms, windows, warmup)})
    sync_ms, _ = _train(flags, work, "sync")
    measured = [w for run in runs for w in run["windows"]]
    saves = [i + 1 for i in range(save_interval, iters, save_interval)]
    sync_quiet = [ms for i, ms in sync_ms.items() if i > warmup and i not in saves]
    return {
        "runs": runs,
        "sync_ms": sync_ms,
        "without_save_ms": statistics.median(ms for w in measured for ms in w["quiet_ms"]) if measured else None,
        "during_save_ms": statistics.median(ms for w in measured for ms in w["busy_ms"]) if measured else None,
        "ratio": statistics.median(w["ratio"] for w in measured) if measured else None,
        "window_ratios": [w["ratio"] for w in measured],
        "snapshot_step_ms": [w["snapshot_ms"] for w in measured],
        "sync_step_ms": statistics.median(sync_quiet),
        "sync_save_step_ms": [sync_ms[i] for i in saves],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2, help="runs with --async-save (their windows pooled)")
    parser.add_argument("--warmup", type=int, default=2, help="leading iterations left out of the medians")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    model_flags = [
        *("--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size)),
        *("--num-attention-heads", str(max(1, args.hidden_size // 64)), "--seq-length", str(args.seq_length)),
        *("--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data", "--vocab-size", str(args.vocab_size)),
        *("--lr", "1e-4", "--distributed-backend", "gloo"),
    ]
    work = tempfile.mkdtemp(prefix="async_save_bench_", dir=args.dir)
    try:
        result = measure(model_flags, args.iters, args.save_interval, args.warmup, args.repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = args.num_layers * 12 * args.hidden_size**2 + args.vocab_size * args.hidden_size
    print(
        f"GPT {args.num_layers}x{args.hidden_size}, vocabulary {args.vocab_size}: ~{params / 1e6:.0f}M parameters, "
        f"~{params * 16 / 2**30:.2f} GiB of weights and Adam state per checkpoint; {args.iters} iterations, a save "
        f"every {args.save_interval}, training on 1 thread"
    )
    for repeat, run in enumerate(result["runs"]):
        print(
            f"async run {repeat} iteration ms:", " ".join(f"{i}:{ms:.0f}" for i, ms in sorted(run["async_ms"].items()))
        )
        for w in run["windows"]:
            print(
                f"  background save of iteration {w['start']}: in flight during iterations {w['start'] + 1}..{w['end']}"
                f", {statistics.median(w['busy_ms']):.0f} ms per step against {statistics.median(w['quiet_ms']):.0f} "
                f"before it ({w['ratio']:.3f}x)"
            )
    if result["ratio"] is None:
        print("no iteration ran while a save was in flight (the saves finished within one step)")
    else:
        print(f"step time without a save in flight (median): {result['without_save_ms']:8.1f} ms")
        print(f"step time during a background save (median):  {result['during_save_ms']:8.1f} ms")
        print(
            f"during / without: {result['ratio']:.3f}x (median of {len(result['window_ratios'])} save windows, "
            "each against the quiet steps just before it)"
        )
        snapshots = ", ".join(f"{ms:.0f}" for ms in result["snapshot_step_ms"])
        print(f"steps that also took the snapshot: {snapshots} ms")
    sync = ", ".join(f"{ms:.0f}" for ms in result["sync_save_step_ms"])
    print(f"synchronous run: step {result['sync_step_ms']:.1f} ms, steps with a save: {sync} ms")
    return finish(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
