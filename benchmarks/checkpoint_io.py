"""Save/load throughput of dist_checkpointing against plain torch.save/torch.load of the same
tensors, in the same process, in alternating trials.

    python benchmarks/checkpoint_io.py                         # CPU: 256 MiB and 1 GiB of fp32 tensors
    python benchmarks/checkpoint_io.py --size-mb 256 --trials 7
    python benchmarks/checkpoint_io.py --device cuda --model gpt-1.3b --json ckpt_io.json

Each trial saves with both (``torch.save`` to a file then ``fsync``; ours fsyncs every file
it writes), then loads with both (``torch.load(weights_only=True)`` onto the device; ours
reads into new tensors on the device, verifying every checksum), the order of the two sides
alternating from trial to trial; outputs are deleted after each trial. Loads read files the
save just wrote (warm page cache), for both sides alike. Prints the median seconds and GB/s
of each side and the ours/plain throughput ratios (>1: ours is faster).

``--model gpt-1.3b`` times the full training state of a 1.3B-parameter GPT (24 layers, hidden
2048, FFN 8192, vocabulary 50304, sequence 2048) as bf16 training with the distributed
optimizer on one GPU holds it: bf16 weights plus fp32 main weights and both Adam moments,
about 18 GB, on ``--device``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from megatron.core.benchmark_report import finish
from megatron.core.dist_checkpointing import ShardedTensor, load, save


def sized_state(size_mb: int, num_tensors: int, dtype: torch.dtype, device: torch.device) -> dict:
    """``num_tensors`` random [rows, 1024] tensors of ``size_mb`` MiB in all."""
    numel = size_mb * 2**20 // (num_tensors * torch.empty((), dtype=dtype).element_size())
    rows = max(1, numel // 1024)
    return {f"layer{i}.weight": torch.randn(rows, 1024, device=device).to(dtype) for i in range(num_tensors)}


def gpt_1p3b_shapes(layers=24, hidden=2048, ffn=8192, vocab=50304, seq=2048) -> dict[str, tuple[int, ...]]:
    shapes = {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "embedding.position_embeddings.weight": (seq, hidden),
    }
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "input_layernorm.bias": (hidden,),
            p + "self_attention.linear_qkv.weight": (3 * hidden, hidden),
            p + "self_attention.linear_qkv.bias": (3 * hidden,),
            p + "self_attention.linear_proj.weight": (hidden, hidden),
            p + "self_attention.linear_proj.bias": (hidden,),
            p + "pre_mlp_layernorm.weight": (hidden,),
            p + "pre_mlp_layernorm.bias": (hidden,),
            p + "mlp.linear_fc1.weight": (ffn, hidden),
            p + "mlp.linear_fc1.bias": (ffn,),
            p + "mlp.linear_fc2.weight": (hidden, ffn),
            p + "mlp.linear_fc2.bias": (hidden,),
        }
    return shapes | {"decoder.final_layernorm.weight": (hidden,), "decoder.final_layernorm.bias": (hidden,)}


def training_state(device: torch.device, shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """bf16 weights and fp32 main weights / exp_avg / exp_avg_sq of the 1.3B GPT (or ``shapes``)."""
    state = {}
    for name, shape in (shapes or gpt_1p3b_shapes()).items():
        weight = torch.randn(shape, device=device, dtype=torch.float32) * 0.02
        state[f"model.{name}"] = weight.to(torch.bfloat16)
        state[f"optimizer.fp32_param.{name}"] = weight
        state[f"optimizer.exp_avg.{name}"] = torch.randn(shape, device=device) * 1e-3
        state[f"optimizer.exp_avg_sq.{name}"] = torch.rand(shape, device=device) * 1e-6
    return state


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def _plain_save(tensors: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


def _save(side: str, tensors: dict, sharded: dict, work: str) -> None:
    if side == "plain":
        _plain_save(tensors, os.path.join(work, "plain.pt"))
    else:
        save(sharded, os.path.join(work, "ours"))


def _load(side: str, sharded: dict, work: str, device: torch.device) -> dict:
    if side == "plain":
        return torch.load(os.path.join(work, "plain.pt"), weights_only=True, map_location=device)
    return load(sharded, os.path.join(work, "ours"))


def run(tensors: dict, trials: int, device: torch.device, base_dir: str) -> dict:
    """Alternating trials of both sides over ``tensors``; per-operation lists of seconds. The
    first trial also checks that both sides load back exactly what was saved."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    # Also the load request: load returns new tensors on the device of the request's data.
    sharded = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
    seconds: dict[str, list[float]] = {op: [] for op in ("plain save", "ours save", "plain load", "ours load")}
    for trial in range(trials):
        work = tempfile.mkdtemp(prefix="ckpt_bench_", dir=base_dir)
        sides = ["plain", "ours"] if trial % 2 == 0 else ["ours", "plain"]
        try:
            for side in sides:
                seconds[f"{side} save"].append(_timed(lambda: _save(side, tensors, sharded, work), device)[0])  # noqa: B023
            for side in sides:
                elapsed, loaded = _timed(lambda: _load(side, sharded, work, device), device)  # noqa: B023
                seconds[f"{side} load"].append(elapsed)
                if trial == 0 and any(not torch.equal(loaded[k], v) for k, v in tensors.items()):
                    raise RuntimeError(f"{side}: the loaded tensors differ from the saved ones")
                del loaded
        finally:
            shutil.rmtree(work)
    return {"bytes": nbytes, "trials": trials, "seconds": seconds}


def summarize(label: str, result: dict) -> dict:
    nbytes = result["bytes"]
    median = {op: statistics.median(values) for op, values in result["seconds"].items()}
    gbps = {op: nbytes / s / 1e9 for op, s in median.items()}
    ratios = {op: gbps[f"ours {op}"] / gbps[f"plain {op}"] for op in ("save", "load")}
    print(f"{label}: {nbytes / 2**20:.0f} MiB, median of {result['trials']} alternating trials")
    for op in median:
        trials = " ".join(f"{s:.3f}" for s in result["seconds"][op])
        print(f"  {op:<11} {median[op]:8.3f} s {gbps[op]:7.2f} GB/s   (trials: {trials})")
    for op, ratio in ratios.items():
        print(f"  ours/plain {op} throughput ratio: {ratio:.2f}")
    return {"label": label, "bytes": nbytes, "median_s": median, "gbps": gbps, "ratio": ratios, **result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, nargs="+", default=[256, 1024], help="total tensor bytes, in MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", choices=["gpt-1.3b"], help="time this model's full training state instead")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--trials", type=int, default=None, help="default: 5 (1 with --model)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (same filesystem for both)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    trials = args.trials or (1 if args.model else 5)
    print(f"torch {torch.__version__}, device {device}, writing under {args.dir}")
    results = []
    if args.model:
        run(sized_state(16, 4, torch.float32, device), 1, device, args.dir)  # warm-up: CUDA context, pinned ring
        state = training_state(device)
        results.append(summarize(f"{args.model} training state on {device}", run(state, trials, device, args.dir)))
    else:
        for size_mb in args.size_mb:
            state = sized_state(size_mb, args.tensors, getattr(torch, args.dtype), device)
            result = run(state, trials, device, args.dir)
            results.append(summarize(f"{args.tensors} {args.dtype} tensors on {device}", result))
    return finish(results, args.json)


if __name__ == "__main__":
    sys.exit(main())
