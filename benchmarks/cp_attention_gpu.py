#!/usr/bin/env python3
"""Ring attention's local block on one GPU: the fused block kernel used inside the ring
(aten's flash attention returning the log-sum-exp, ``SdpaBlockAttention``) against plain
``F.scaled_dot_product_attention`` on the same chunk shapes, bf16, in the same process.

    python -m benchmarks.cp_attention_gpu [--quick] [--output-json cp_attention_gpu.json]

With sequence S and CP = c every rank holds two chunks of L = S / (2c) tokens, and each ring
step computes one of three blocks (see ``ring_attention.ring_plan``): the causal local block
(2L x 2L), an earlier rank's first chunk seen by every local query (2L x L), and a later
rank's whole K/V seen by the late chunk (L x 2L). For each (S, c) and block the benchmark
times forward and forward+backward of both (alternating trials, median), checks the fused
kernel's output, log-sum-exp and gradients against plain SDPA, and prints plain / fused time
ratios. It also times one rank's whole ring computation (every step's block plus the
log-sum-exp merges, no communication) against the ideal 1/c of plain causal SDPA over the
whole sequence on one GPU. CP itself needs two or more GPUs; this measures the local compute.

Exits with status 2 where CUDA is missing (``--device cpu`` runs the same checks on small
shapes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megatron.core.benchmark_report import write_report
from megatron.core.transformer.context_parallel.block_attention import SdpaBlockAttention
from megatron.core.transformer.context_parallel.ring_attention import merge_block, ring_plan


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-groups", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=10, help="calls per timed trial")
    p.add_argument("--quick", action="store_true", help="S = 8192 at c = 2 only, 3 trials")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a small-shape check of the same code")
    p.add_argument("--output-json", default="cp_attention_gpu.json")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lengths, args.cp_sizes, args.trials = [8192], [2], 3
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _seconds(fn, iters, device) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _median_pair(fused, plain, args, device) -> tuple[float, float]:
    """Median ms of ``fused`` and ``plain`` over alternating trials."""
    times = {"fused": [], "plain": []}
    for trial in range(args.trials):
        order = [("fused", fused), ("plain", plain)]
        for name, fn in order if trial % 2 == 0 else order[::-1]:
            times[name].append(1000 * _seconds(fn, args.iters, device))
    return statistics.median(times["fused"]), statistics.median(times["plain"])


def _inputs(args, q_len, kv_len, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(q_len * 7 + kv_len)
    shape = (args.batch, args.heads, q_len, args.head_dim)
    kv_shape = (args.batch, args.kv_groups, kv_len, args.head_dim)
    q = torch.randn(shape, generator=g).to(device, dtype)
    k, v = (torch.randn(kv_shape, generator=g).to(device, dtype) for _ in range(2))
    return q, k, v, torch.randn(shape, generator=g).to(device, dtype)


def _plain(q, k, v, causal, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def block_case(args, seq, cp, block, device, dtype) -> dict:
    chunk = seq // (2 * cp)
    q_len, kv_len, causal = {
        "causal_local": (2 * chunk, 2 * chunk, True),
        "earlier_rank": (2 * chunk, chunk, False),
    }.get(block, (chunk, 2 * chunk, False))
    q, k, v, dout = _inputs(args, q_len, kv_len, device, dtype)
    scale = args.head_dim**-0.5
    fused = SdpaBlockAttention()

    # Correctness: fused vs plain SDPA (autograd) from the same bf16 inputs.
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    expected = _plain(qa, ka, va, causal, scale)
    expected.backward(dout)
    out, lse, aux = fused.forward(q, k, v, causal, scale)
    grads = fused.backward(dout, q, k, v, out, lse, aux, causal, scale)
    # The log-sum-exp reference on the first query head of each of the first two groups (fp32
    # scores of every head would not fit at the long sequences).
    heads = [0, args.heads // args.kv_groups]
    scores = torch.matmul(q[0, heads].float(), k[0, :2].float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(q_len, kv_len, dtype=torch.bool, device=device).triu(1), float("-inf"))
    errors = {
        "max_abs_err_out": (out.float() - expected.float()).abs().max().item(),
        "max_abs_err_lse": (lse[0, heads].float() - torch.logsumexp(scores, -1)).abs().max().item(),
        "max_abs_err_grad": max(
            (mine.float() - ref.grad.float()).abs().max().item() for mine, ref in zip(grads, (qa, ka, va), strict=True)
        ),
    }
    del scores, expected, qa, ka, va

    def fused_fwd():
        fused.forward(q, k, v, causal, scale)

    def plain_fwd():
        _plain(q, k, v, causal, scale)

    def fused_fwd_bwd():
        o, l_, aux_ = fused.forward(q, k, v, causal, scale)
        fused.backward(dout, q, k, v, o, l_, aux_, causal, scale)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def plain_fwd_bwd():
        _plain(qg, kg, vg, causal, scale).backward(dout)

    fused_ms, plain_ms = _median_pair(fused_fwd, plain_fwd, args, device)
    fused_fb_ms, plain_fb_ms = _median_pair(fused_fwd_bwd, plain_fwd_bwd, args, device)
    return {
        "seq": seq,
        "cp": cp,
        "block": block,
        "q_len": q_len,
        "kv_len": kv_len,
        "causal": causal,
        "fused_fwd_ms": fused_ms,
        "plain_fwd_ms": plain_ms,
        "fwd_ratio_plain_over_fused": plain_ms / fused_ms,
        "fused_fwd_bwd_ms": fused_fb_ms,
        "plain_fwd_bwd_ms": plain_fb_ms,
        "fwd_bwd_ratio_plain_over_fused": plain_fb_ms / fused_fb_ms,
        **errors,
    }


def ring_case(args, seq, cp, device, dtype) -> dict:
    """One rank's ring forward computation (rank 0; every rank has the same work) vs 1/c of
    plain causal SDPA over the whole sequence."""
    chunk = seq // (2 * cp)
    q, k, v, _ = _inputs(args, 2 * chunk, 2 * chunk, device, dtype)
    whole_q, whole_k, whole_v, _ = _inputs(args, seq, seq, device, dtype)
    scale = args.head_dim**-0.5
    fused, plan = SdpaBlockAttention(), ring_plan(0, cp, chunk)

    def ring_forward():
        out = torch.zeros(q.shape, dtype=torch.float32, device=device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=device)
        for step in plan:  # the K/V of other ranks would arrive here; their shapes are the same
            block_out, block_lse, _ = fused.forward(
                q[..., step.q_rows, :], k[..., step.kv_rows, :], v[..., step.kv_rows, :], step.causal, scale
            )
            merge_block(out, lse, step.q_rows, block_out, block_lse)
        return out

    def whole_causal():
        _plain(whole_q, whole_k, whole_v, True, scale)

    ring_ms, whole_ms = _median_pair(ring_forward, whole_causal, args, device)
    return {
        "seq": seq,
        "cp": cp,
        "ring_fwd_ms": ring_ms,
        "whole_sequence_causal_sdpa_ms": whole_ms,
        "ideal_ms": whole_ms / cp,
        "efficiency_ideal_over_ring": (whole_ms / cp) / ring_ms,
    }


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; this benchmark needs a GPU (or --device cpu for a small check)")
        return 2
    dtype = torch.bfloat16
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "shape": {"batch": args.batch, "heads": args.heads, "kv_groups": args.kv_groups, "head_dim": args.head_dim},
        "blocks": [],
        "ring": [],
    }
    failures = []
    for seq in args.seq_lengths:
        for cp in args.cp_sizes:
            if seq % (2 * cp):
                continue
            for block in ("causal_local", "earlier_rank", "later_rank"):
                case = block_case(args, seq, cp, block, device, dtype)
                result["blocks"].append(case)
                print(
                    f"S={seq:6d} cp={cp} {block:13s} {case['q_len']:6d}x{case['kv_len']:<6d} "
                    f"fwd fused {case['fused_fwd_ms']:.3f} ms plain {case['plain_fwd_ms']:.3f} ms "
                    f"(x{case['fwd_ratio_plain_over_fused']:.2f})  fwd+bwd fused {case['fused_fwd_bwd_ms']:.3f} ms "
                    f"plain {case['plain_fwd_bwd_ms']:.3f} ms (x{case['fwd_bwd_ratio_plain_over_fused']:.2f})  "
                    f"err out {case['max_abs_err_out']:.1e} lse {case['max_abs_err_lse']:.1e} "
                    f"grad {case['max_abs_err_grad']:.1e}"
                )
                if max(case["max_abs_err_out"], case["max_abs_err_lse"]) > 5e-2 or case["max_abs_err_grad"] > 1e-1:
                    failures.append(f"S={seq} cp={cp} {block}: fused kernel differs from plain SDPA")
            ring = ring_case(args, seq, cp, device, dtype)
            result["ring"].append(ring)
            print(
                f"S={seq:6d} cp={cp} ring (one rank, compute only) {ring['ring_fwd_ms']:.3f} ms vs ideal "
                f"{ring['ideal_ms']:.3f} ms (whole-sequence SDPA / cp): "
                f"efficiency {ring['efficiency_ideal_over_ring']:.2f}"
            )
            write_report(result, args.output_json)  # after every case: a later crash keeps the numbers
    result["failures"] = failures
    write_report(result, args.output_json)
    for line in failures:
        print("FAIL", line)
    print(f"wrote {args.output_json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
