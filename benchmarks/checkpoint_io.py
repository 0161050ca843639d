"""Save/load throughput of dist_checkpointing against plain torch.save/torch.load of the same
tensors, in the same run.

Usage: python benchmarks/checkpoint_io.py [--size-mb 512] [--tensors 16] [--dtype float32] [--dir /tmp]

Runs in one process (no torch.distributed). Each tensor is one whole piece. Both paths write
to the same filesystem; ours also fsyncs and checksums, plain torch.save does not fsync.
Prints GB/s of each and ours / plain ratios.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

from megatron.core.dist_checkpointing import ShardedTensor, load, save


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(size_mb: int, num_tensors: int, dtype: torch.dtype, base_dir: str) -> dict:
    """Time one save and one load of each kind; returns seconds and GB/s per operation."""
    element_size = torch.empty((), dtype=dtype).element_size()
    numel = size_mb * 2**20 // (num_tensors * element_size)
    rows = max(1, numel // 1024)
    tensors = {f"layer{i}.weight": torch.randn(rows, 1024).to(dtype) for i in range(num_tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    work = tempfile.mkdtemp(prefix="ckpt_bench_", dir=base_dir)
    try:
        plain_path = os.path.join(work, "plain.pt")
        ours_path = os.path.join(work, "ours")
        sharded = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
        request = {
            k: ShardedTensor(k, None, v.dtype, tuple(v.shape), tuple(v.shape), (0, 0), None) for k, v in tensors.items()
        }
        seconds = {
            "plain save": _timed(lambda: torch.save(tensors, plain_path))[0],
            "ours save": _timed(lambda: save(sharded, ours_path))[0],
        }
        seconds["plain load"], plain = _timed(lambda: torch.load(plain_path, weights_only=True))
        seconds["ours load"], ours = _timed(lambda: load(request, ours_path))
        for key, value in tensors.items():
            if not (torch.equal(plain[key], value) and torch.equal(ours[key], value)):
                raise RuntimeError(f"round trip of {key} differs")
    finally:
        shutil.rmtree(work)
    return {"bytes": nbytes, "seconds": seconds, "gbps": {k: nbytes / s / 1e9 for k, s in seconds.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512, help="total tensor bytes, in MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (same filesystem for both)")
    args = parser.parse_args(argv)
    result = run(args.size_mb, args.tensors, getattr(torch, args.dtype), args.dir)
    print(f"{result['bytes'] / 2**20:.0f} MiB in {args.tensors} {args.dtype} tensors under {args.dir}")
    for name, seconds in result["seconds"].items():
        print(f"{name:<11} {seconds:8.3f} s  {result['gbps'][name]:7.2f} GB/s")
    for op in ("save", "load"):
        print(f"ours/plain {op} throughput ratio: {result['gbps'][f'ours {op}'] / result['gbps'][f'plain {op}']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
