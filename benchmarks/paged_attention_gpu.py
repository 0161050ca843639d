"""GPU check (not a test) of the fused Triton paged-attention kernel:

1. Kernel vs the torch reference on CUDA, in fp32 and bf16, on a NaN-poisoned cache with a
   batch mixing prefill chunks and decode tokens (GQA, scattered blocks): max difference, and
   the time of each.
2. The saturation regression of ``tests/unit_tests/inference/engines/test_saturation.py`` on
   CUDA for its tiny GPT: NaN-poisoned free pages, a 10-block pool with a 3-block paused budget
   vs a roomy pool, with the Triton backend forced; greedy tokens must be equal tight vs roomy
   and equal to the torch backend's. Prints pauses, evictions and output tokens/s of both
   backends.

    python -m benchmarks.paged_attention_gpu        (from the repo root; about a minute on one H200)

Exits with status 2 (and says why) where CUDA or Triton is missing, 1 when a check fails.
Safe to import anywhere: nothing runs at import time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.cuda_timing import cuda_timed


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=48, help="requests in the kernel check (a third prefill)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    return p.parse_args(argv)


def _poisoned_batch(args, dtype):
    """Paged-attention arguments on CUDA: every third request a prefill chunk, the rest decode
    tokens, on shuffled blocks of a cache that holds NaN wherever no request wrote."""
    g = torch.Generator().manual_seed(0)
    kv_lengths = torch.randint(args.prefill_chunk, args.max_context + 1, (args.requests,), generator=g)
    query_lengths = torch.where(torch.arange(args.requests) % 3 == 0, args.prefill_chunk, 1)
    blocks_per_request = (kv_lengths + args.block_size - 1) // args.block_size
    num_blocks = int(blocks_per_request.sum()) + 8
    order = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(args.requests, int(blocks_per_request.max()), dtype=torch.long)
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    key_cache = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    value_cache = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    used = 0
    for row, (length, n) in enumerate(zip(kv_lengths.tolist(), blocks_per_request.tolist(), strict=True)):
        table = order[used : used + n]
        used += n
        block_tables[row, :n] = table
        slots = (table[:, None] * args.block_size + torch.arange(args.block_size)).flatten()[:length].cuda()
        for cache in (key_cache, value_cache):
            cache.view(-1, args.kv_heads, args.head_dim)[slots] = torch.randn(
                length, args.kv_heads, args.head_dim, device="cuda", dtype=dtype
            )
    query = torch.randn(int(query_lengths.sum()), args.q_heads, args.head_dim, device="cuda", dtype=dtype)
    return query, key_cache, value_cache, block_tables.cuda(), query_lengths.cuda(), kv_lengths.cuda()


def _kernel_check(args) -> bool:
    from megatron.core.inference.contexts.paged_attention import torch_paged_attention
    from megatron.core.inference.contexts.paged_attention_triton import (
        triton_paged_attention,
    )

    print(
        f"1. kernel vs torch reference: {args.requests} requests (a third {args.prefill_chunk}-token prefill "
        f"chunks), contexts up to {args.max_context}, block {args.block_size}, heads {args.q_heads}/"
        f"{args.kv_heads} x {args.head_dim}, NaN in every unwritten slot"
    )
    ok = True
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        batch = _poisoned_batch(args, dtype)
        fast, ref = triton_paged_attention(*batch).float(), torch_paged_attention(*batch).float()
        diff = (fast - ref).abs().max().item()
        finite = bool(torch.isfinite(fast).all())
        t_fast = cuda_timed(lambda batch=batch: triton_paged_attention(*batch), args.iters)
        t_ref = cuda_timed(lambda batch=batch: torch_paged_attention(*batch), args.iters)
        ok &= finite and diff <= tolerance
        print(
            f"   {dtype!s:15s} max |triton - torch| = {diff:.3e} (allowed {tolerance:g}), finite {finite}; "
            f"triton {t_fast * 1e3:.2f} ms, torch {t_ref * 1e3:.2f} ms ({t_ref / t_fast:.1f}x)"
        )
    return ok


def _generate(pg, backend: str, num_blocks: int, paused_block_budget: int):
    """One saturation run with ``backend`` forced: results, engine stats, NaN-owned-page count,
    output tokens/s."""
    from megatron.core.inference.contexts.paged_attention import BACKEND_ENV
    from tests.unit_tests.inference.engines.common import gpt_model
    from tests.unit_tests.inference.engines.test_saturation import (
        _generate as saturation_run,
    )

    os.environ[BACKEND_ENV] = backend
    torch.cuda.synchronize()
    start = time.perf_counter()
    results, stats, _, watch = saturation_run(pg, gpt_model, num_blocks, paused_block_budget)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(r["tokens"]) for r in results.values())
    return results, stats, watch.nonfinite_owned_pages, tokens / seconds


def _saturation_check() -> bool:
    from megatron.core.process_groups import ProcessGroupCollection, RankLayout

    pg = ProcessGroupCollection.from_layout(RankLayout())
    print(
        "2. saturation on CUDA (tiny GPT, 8 prompts x 64 greedy tokens): 10-block pool + 3-block paused "
        "budget vs 100-block pool, NaN-poisoned free pages"
    )
    _generate(pg, "triton", 100, 100)  # warm-up: compiles the kernel for this model's shapes
    runs = {
        (backend, pool): _generate(pg, backend, *sizes)
        for backend in ("triton", "torch")
        for pool, sizes in (("roomy", (100, 100)), ("tight", (10, 3)))
    }
    ok = True
    for (backend, pool), (_results, stats, nonfinite, tokens_per_s) in runs.items():
        print(
            f"   {backend:6s} {pool:5s}: pauses {stats['pauses']}, evictions {stats['evictions']}, "
            f"owned pages with NaN {nonfinite}, {tokens_per_s:.0f} output tokens/s"
        )
        ok &= nonfinite == 0
    tokens = {key: {rid: r["tokens"] for rid, r in value[0].items()} for key, value in runs.items()}
    checks = {
        "triton tight == triton roomy": tokens["triton", "tight"] == tokens["triton", "roomy"],
        "triton tight == torch roomy": tokens["triton", "tight"] == tokens["torch", "roomy"],
        "torch tight == torch roomy": tokens["torch", "tight"] == tokens["torch", "roomy"],
        "tight pool paused and evicted": runs["triton", "tight"][1]["pauses"] > 0
        and runs["triton", "tight"][1]["evictions"] > 0,
    }
    log_prob_diff = max(
        abs(a - b)
        for rid, r in runs["triton", "tight"][0].items()
        for a, b in zip(r["log_probs"], runs["torch", "roomy"][0][rid]["log_probs"], strict=True)
    )
    for name, passed in checks.items():
        print(f"   {name}: {'ok' if passed else 'FAILED'}")
    print(f"   max |log-prob triton tight - torch roomy| = {log_prob_diff:.3e}")
    return ok and all(checks.values())


def run(args) -> int:
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to check (run this on a GPU machine)")
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton does not import (pip install triton): nothing to check")
        return 2
    torch.cuda.set_device(0)
    ok = _kernel_check(args)
    with tempfile.TemporaryDirectory() as tmp:
        # One NCCL rank: the test helpers then build their models on CUDA.
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            ok &= _saturation_check()
        finally:
            dist.destroy_process_group()
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run(_parse_args(sys.argv[1:])))
