"""Timing helper shared by the GPU benchmarks."""

import time

import torch


def cuda_timed(fn, iters: int) -> float:
    """Mean seconds per call of ``fn`` on CUDA after one warm-up call (Triton compiles on the first)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters
