"""GPU micro-benchmark and check (not a test) of the inference kernels, against their anchors in
the same process, with the achieved bandwidth against a measured device-to-device copy:

0. copy bandwidth: a 1 GiB ``copy_`` (read + write counted) — the roofline every "% of
   bandwidth" below refers to.
1. paged decode attention (ours vs the torch reference) at the 1.4B model's heads (16 MHA x 128,
   blocks of 16) and a GQA shape (32 / 8 x 128), 1..256 requests at short (128-256) and long
   (1.5k-2.5k) contexts, plus a mixed prefill + decode step: GPU time, bytes of K/V read / time,
   % of the copy bandwidth; max difference to the reference on NaN-poisoned caches.
2. the batch-invariant GEMM vs ``torch.matmul`` (cuBLAS) at M = 1, 8, 64, 256 for the 1.4B
   model's linears (QKV 6144x2048, out-proj 2048x2048, fc1 11008x2048 SwiGLU, fc2 2048x5504, output
   50304x2048), bytes / time, % of bandwidth; per-row bitwise invariance across M; the linears of
   one decode step of the 24-layer model vs its weights-read time.
3. the per-row log-softmax vs torch at [M, 50304].
4. Mamba (the hybrid 1.3B mixer: 64 heads x 64, 8 groups, state 128): prefill through our
   recurrence vs the chunked scan (mamba-ssm's ``mamba_chunk_scan_combined``, per request from
   its state, as the batch-variant mode runs it) vs the torch token-by-token loop; decode through
   our in-place kernels vs mamba-ssm's ``selective_state_update`` vs the torch step; SSM-state
   bytes / time; split invariance.
5. one decode step of the models (64 requests at 128 tokens of context, through the dynamic
   context): the 1.4B Llama-style GPT and the hybrid model of the training issue
   (``M-M-M-M*-M-M-M-M*-M-M-M-``), the fused ops of :mod:`megatron.core.fusions` (norms with the
   residual add, RoPE in the QKV split, SwiGLU) on Triton vs their torch path, batch-variant and
   batch-invariant mode, eager and from a CUDA graph: step time, GPU ops per step (profiler),
   graph replay == eager bitwise, fused vs torch logits.

    python -m benchmarks.inference_kernels_gpu [--json inference_kernels_gpu.json]   (repo root)

GPU times are CUDA-graph replays of back-to-back calls where the function can be captured (no
launch gaps: what a captured decode step sees), else eager calls between synchronizations; the
median over alternating trials. Writes every number to the JSON file; exits with 2 (and says
why) without CUDA or Triton, 1 when a check fails. Safe to import anywhere: nothing runs at
import time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from collections.abc import Callable

import torch

from megatron.core.benchmark_report import write_report

DEVICE = torch.device("cuda")
GIB = 1 << 30
GEMM_SHAPES = {
    "qkv": (6144, 2048),
    "proj": (2048, 2048),
    "fc1": (11008, 2048),
    "fc2": (2048, 5504),
    "output": (50304, 2048),
}
LAYERS = 24
ROWS = (1, 8, 64, 256)


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="inference_kernels_gpu.json", help="where to write the results")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed replay")
    p.add_argument("--trials", type=int, default=5, help="alternating trials per comparison (median)")
    return p.parse_args(argv)


class Timer:
    """Seconds per call of each function: ``calls`` calls captured in one CUDA graph and replayed
    (``capturable``), else called eagerly; median over alternating trials (after a warm-up)."""

    def __init__(self, calls: int, trials: int):
        self.calls, self.trials = calls, trials

    def _runner(self, fn: Callable, capturable: bool) -> Callable[[], None]:
        fn()  # compile / warm up
        torch.cuda.synchronize()
        if capturable:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(self.calls):
                    fn()
            return graph.replay

        def eager():
            for _ in range(self.calls):
                fn()

        return eager

    def __call__(self, fns: dict[str, tuple[Callable, bool]]) -> dict[str, float]:
        runners = {name: self._runner(fn, capturable) for name, (fn, capturable) in fns.items()}
        samples = {name: [] for name in fns}
        for _ in range(self.trials):
            for name, run in runners.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3 / self.calls)
        return {name: statistics.median(values) for name, values in samples.items()}


def copy_bandwidth(timer: Timer) -> float:
    src = torch.empty(GIB, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * GIB / timer({"copy": (lambda: dst.copy_(src), True)})["copy"]


# ---- 1. paged attention --------------------------------------------------------------------
def _attention_batch(requests, q_heads, kv_heads, kv_range, q_len_of, block_size=16, head_dim=128, seed=0):
    """Paged-attention arguments (bf16) on shuffled blocks of a cache that holds NaN wherever no
    request wrote; ``q_len_of(i)`` new tokens for request ``i``."""
    g = torch.Generator().manual_seed(seed)
    kv_lengths = torch.randint(kv_range[0], kv_range[1] + 1, (requests,), generator=g)
    query_lengths = torch.tensor([min(q_len_of(i), int(kv_lengths[i])) for i in range(requests)])
    blocks = (kv_lengths + block_size - 1) // block_size
    num_blocks = int(blocks.sum()) + 1
    order = torch.randperm(num_blocks - 1, generator=g)
    tables = torch.full((requests, int(blocks.max())), num_blocks - 1, dtype=torch.long)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    value_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    slot_used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    used = 0
    for row, (length, n) in enumerate(zip(kv_lengths.tolist(), blocks.tolist(), strict=True)):
        table = order[used : used + n]
        used += n
        tables[row, :n] = table
        slot_used[(table[:, None] * block_size + torch.arange(block_size)).flatten()[:length]] = True
    unused = (~slot_used).nonzero().squeeze(1).to(DEVICE)
    for cache in (key_cache, value_cache):
        cache.view(-1, kv_heads, head_dim)[unused] = float("nan")
    query = torch.randn(int(query_lengths.sum()), q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    kv_bytes = int(kv_lengths.sum()) * kv_heads * head_dim * 2 * 2
    return (query, key_cache, value_cache, tables.to(DEVICE), query_lengths.to(DEVICE), kv_lengths.to(DEVICE)), kv_bytes


def attention_section(timer: Timer, copy_bw: float, checks: dict) -> list[dict]:
    from megatron.core.inference.contexts.paged_attention import torch_paged_attention
    from megatron.core.inference.contexts.paged_attention_triton import triton_paged_attention

    cases = []
    for heads_name, (q_heads, kv_heads) in (("MHA 16/16", (16, 16)), ("GQA 32/8", (32, 8))):
        for context_name, kv_range in (("short", (128, 256)), ("long", (1536, 2560))):
            for requests in ROWS:
                cases.append((heads_name, q_heads, kv_heads, context_name, kv_range, requests, lambda i: 1))
    mixed = "mixed: 2 x 256 prefill + 62 decode"
    cases.append(("MHA 16/16", 16, 16, mixed, (256, 512), 64, lambda i: 256 * (i < 2) + 1))
    rows = []
    for heads_name, q_heads, kv_heads, context_name, kv_range, requests, q_len_of in cases:
        args, kv_bytes = _attention_batch(requests, q_heads, kv_heads, kv_range, q_len_of)
        ours = triton_paged_attention(*args, validate=False)
        with_reference = requests * kv_range[1] <= 64 * 512
        fns = {"ours": (lambda args=args: triton_paged_attention(*args, validate=False), True)}
        if with_reference:
            want = torch_paged_attention(*args).float()
            diff = (ours.float() - want).abs().max().item()
            checks[f"attention {heads_name} {context_name} x{requests}: finite, |ours - torch| <= 2e-2"] = (
                bool(torch.isfinite(ours).all()) and diff <= 2e-2
            )
            fns["torch"] = (lambda args=args: torch_paged_attention(*args), False)
        times = timer(fns)
        row = {
            "heads": heads_name,
            "context": context_name,
            "requests": requests,
            "query_tokens": int(args[0].shape[0]),
            "kv_bytes": kv_bytes,
            "ours_ms": times["ours"] * 1e3,
            "ours_GBps": kv_bytes / times["ours"] / 1e9,
            "ours_pct_of_copy_bw": 100 * kv_bytes / times["ours"] / copy_bw,
        }
        if with_reference:
            row |= {"torch_ms": times["torch"] * 1e3, "speedup": times["torch"] / times["ours"], "max_diff": diff}
        rows.append(row)
        print(
            f"   {heads_name:9s} {context_name:36s} x{requests:<4d} ours {row['ours_ms']:8.3f} ms "
            f"{row['ours_GBps']:7.0f} GB/s ({row['ours_pct_of_copy_bw']:4.0f}% of copy)"
            + (f"  torch {row['torch_ms']:9.3f} ms ({row['speedup']:6.1f}x)  diff {diff:.1e}" if with_reference else "")
        )
        del args
    return rows


# ---- 2. GEMM -------------------------------------------------------------------------------
def gemm_section(timer: Timer, copy_bw: float, checks: dict) -> dict:
    from megatron.core.inference.kernels.matmul_triton import device_sm_count, tile_config, triton_linear

    rows, per_step = [], {m: {"ours": 0.0, "cublas": 0.0} for m in ROWS}
    sms = device_sm_count(torch.cuda.current_device())
    for name, (n, k) in GEMM_SHAPES.items():
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
        x_all = torch.randn(max(ROWS), k, device=DEVICE, dtype=torch.bfloat16)
        full = triton_linear(x_all, w)
        invariant = all(torch.equal(triton_linear(x_all[:m], w), full[:m]) for m in (1, 2, 3, 8, 31, 64, 100))
        want = x_all.float() @ w.float().t()
        close = (full.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
        checks[f"GEMM {name}: rows bitwise equal across M, close to fp32"] = invariant and close
        for m in ROWS:
            config = tile_config(n, k, m, 2, sms)
            x = x_all[:m].contiguous()
            times = timer(
                {
                    "ours": (lambda x=x, w=w: triton_linear(x, w), True),
                    "cublas": (lambda x=x, w=w: torch.matmul(x, w.t()), True),
                }
            )
            nbytes = (n * k + m * k + m * n) * 2
            count = 1 if name == "output" else LAYERS
            for side in ("ours", "cublas"):
                per_step[m][side] += count * times[side]
            row = {
                "linear": name,
                "N": n,
                "K": k,
                "M": m,
                "tile": f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages}",
                "ours_us": times["ours"] * 1e6,
                "cublas_us": times["cublas"] * 1e6,
                "ours_vs_cublas": times["cublas"] / times["ours"],
                "ours_pct_of_copy_bw": 100 * nbytes / times["ours"] / copy_bw,
                "cublas_pct_of_copy_bw": 100 * nbytes / times["cublas"] / copy_bw,
            }
            rows.append(row)
            print(
                f"   {name:6s} {n:5d}x{k:<5d} M={m:<4d} ours {row['ours_us']:8.1f} us "
                f"({row['ours_pct_of_copy_bw']:4.0f}% bw)  cuBLAS {row['cublas_us']:8.1f} us "
                f"({row['cublas_pct_of_copy_bw']:4.0f}% bw)  cuBLAS/ours {row['ours_vs_cublas']:.2f}  [{row['tile']}]"
            )
        del w, x_all, full, want
    weight_bytes = 2 * sum(n * k * (1 if name == "output" else LAYERS) for name, (n, k) in GEMM_SHAPES.items())
    weights_read_s = weight_bytes / copy_bw
    step = {
        m: {
            "ours_ms": per_step[m]["ours"] * 1e3,
            "cublas_ms": per_step[m]["cublas"] * 1e3,
            "ours_over_weights_read": per_step[m]["ours"] / weights_read_s,
        }
        for m in ROWS
    }
    print(
        f"   one decode step's linears (24 layers + output; weights {weight_bytes / GIB:.2f} GiB, "
        f"read in {weights_read_s * 1e3:.3f} ms at the copy bandwidth):"
    )
    for m, s in step.items():
        print(
            f"     M={m:<4d} ours {s['ours_ms']:.3f} ms ({s['ours_over_weights_read']:.2f}x weights-read), "
            f"cuBLAS {s['cublas_ms']:.3f} ms"
        )
    return {"shapes": rows, "decode_step_linears": step, "weights_read_ms": weights_read_s * 1e3}


# ---- 3. log-softmax ------------------------------------------------------------------------
def log_softmax_section(timer: Timer, checks: dict) -> list[dict]:
    from megatron.core.inference.kernels.log_softmax_triton import triton_log_softmax

    logits = torch.randn(max(ROWS), 50304, device=DEVICE) * 4
    full = triton_log_softmax(logits)
    checks["log-softmax: rows bitwise equal across M, close to torch"] = (
        all(torch.equal(triton_log_softmax(logits[:m]), full[:m]) for m in ROWS)
        and (full - torch.log_softmax(logits, -1)).abs().max().item() <= 1e-4
    )
    rows = []
    for m in ROWS:
        x = logits[:m].contiguous()
        times = timer(
            {"ours": (lambda x=x: triton_log_softmax(x), True), "torch": (lambda x=x: torch.log_softmax(x, -1), True)}
        )
        rows.append({"M": m, "ours_us": times["ours"] * 1e6, "torch_us": times["torch"] * 1e6})
        print(f"   M={m:<4d} ours {times['ours'] * 1e6:7.1f} us  torch {times['torch'] * 1e6:7.1f} us")
    return rows


# ---- 4. Mamba ------------------------------------------------------------------------------
HEADS, HEAD_DIM, GROUPS, STATE, WIDTH = 64, 64, 8, 128, 4
CHANNELS = HEADS * HEAD_DIM + 2 * GROUPS * STATE


def _mamba_params():
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=DEVICE, generator=g) * scale + shift).bfloat16()

    return dict(
        conv_weight=rand(CHANNELS, 1, WIDTH, scale=0.3),
        conv_bias=rand(CHANNELS, scale=0.1),
        A_log=torch.rand(HEADS, device=DEVICE, generator=g) * 2 - 1,
        D=rand(HEADS),
        dt_bias=rand(HEADS, shift=-3.0),
    )


def _token_loop(p, xBC, dt, conv_state, ssm_state):
    """The torch reference recurrence, one token at a time (the CPU path's arithmetic)."""
    from megatron.core.ssm.backends import TorchSSMBackend

    A = -torch.exp(p["A_log"])
    ys = []
    for t in range(xBC.shape[1]):
        window = torch.cat([conv_state.to(xBC.dtype), xBC[:, t, :, None]], dim=-1)
        conv_state.copy_(window[..., 1:])
        conv = torch.nn.functional.silu((window * p["conv_weight"].squeeze(1)).sum(-1) + p["conv_bias"])
        x, B, C = conv.split([HEADS * HEAD_DIM, GROUPS * STATE, GROUPS * STATE], -1)
        b = x.shape[0]
        ys.append(
            TorchSSMBackend.state_update(
                ssm_state,
                x.reshape(b, HEADS, HEAD_DIM),
                dt[:, t],
                A,
                B.reshape(b, GROUPS, STATE),
                C.reshape(b, GROUPS, STATE),
                p["D"],
                p["dt_bias"],
            )
        )
    return torch.stack(ys, 1)


def _mamba_decode(timer, copy_bw, checks, p, kernels, ours, slots, r, result) -> dict:
    """One decode step of ``r`` requests (slots scattered in a pool twice the batch): our
    in-place kernels vs the torch step vs ``selective_state_update`` on contiguous states."""
    from megatron.core.ssm.backends import get_ssm_backend

    conv_slots, ssm_slots = slots(2 * r)
    slot_ids = torch.randperm(2 * r, device=DEVICE)[:r]
    cu = torch.arange(r + 1, device=DEVICE)
    xBC = torch.randn(r, CHANNELS, device=DEVICE).bfloat16()
    dt = torch.randn(r, HEADS, device=DEVICE).bfloat16()
    conv_copy, ssm_copy = conv_slots[slot_ids].clone(), ssm_slots[slot_ids].clone()
    if r == 64:
        got = ours(xBC, dt, conv_slots.clone(), ssm_slots.clone(), slot_ids, cu)
        want = _token_loop(p, xBC[:, None], dt[:, None], conv_copy.clone(), ssm_copy.clone())[:, 0].flatten(1)
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        checks["Mamba decode: ours vs the torch step (bf16), relative error <= 2e-2"] = rel <= 2e-2
        result["decode_vs_torch_rel_err"] = rel
    fns = {
        "ours": (lambda: ours(xBC, dt, conv_slots, ssm_slots, slot_ids, cu), True),
        "torch step": (lambda: _token_loop(p, xBC[:, None], dt[:, None], conv_copy, ssm_copy), True),
    }
    if kernels is not None:
        x, B, C = xBC.split([HEADS * HEAD_DIM, GROUPS * STATE, GROUPS * STATE], -1)
        x, B, C = x.reshape(r, HEADS, HEAD_DIM), B.reshape(r, GROUPS, STATE), C.reshape(r, GROUPS, STATE)
        backend = get_ssm_backend(DEVICE, "triton")
        A = -torch.exp(p["A_log"])
        fns["selective_state_update"] = (
            lambda: backend.state_update(ssm_copy, x, dt, A, B, C, p["D"], p["dt_bias"]),
            True,
        )
    times = timer(fns)
    nbytes = 2 * r * HEADS * HEAD_DIM * STATE * 4  # the SSM state read and written
    row = {"requests": r} | {f"{k}_us": v * 1e6 for k, v in times.items()}
    row["ours_state_GBps"] = nbytes / times["ours"] / 1e9
    row["ours_pct_of_copy_bw"] = 100 * nbytes / times["ours"] / copy_bw
    print(
        f"   decode x{r:<4d} "
        + "  ".join(f"{k} {v * 1e6:8.1f} us" for k, v in times.items())
        + f"  (ours: state {row['ours_state_GBps']:.0f} GB/s, {row['ours_pct_of_copy_bw']:.0f}% of copy)"
    )
    return row


def mamba_section(timer: Timer, copy_bw: float, checks: dict) -> dict:
    from megatron.core.ssm.backends import get_ssm_backend, load_mamba_kernels
    from megatron.core.ssm.inference_triton import packed_recurrence
    from megatron.core.ssm.mixer_reference import causal_conv1d_silu

    p = _mamba_params()
    kernels = load_mamba_kernels()
    if kernels is None:
        print("   mamba-ssm's kernels do not import: only our kernels and the torch path are timed")
    result = {"mamba_ssm": kernels is not None, "decode": [], "prefill": []}

    def slots(n):
        return (
            torch.zeros(n, CHANNELS, WIDTH - 1, device=DEVICE),
            torch.randn(n, HEADS, HEAD_DIM, STATE, device=DEVICE) * 0.1,
        )

    def ours(xBC, dt, conv_slots, ssm_slots, slot_ids, cu):
        args = (p["conv_weight"], p["conv_bias"], p["A_log"], p["D"], p["dt_bias"])
        return packed_recurrence(xBC, dt, *args, conv_slots, ssm_slots, slot_ids, cu, GROUPS)

    for r in ROWS:
        result["decode"].append(_mamba_decode(timer, copy_bw, checks, p, kernels, ours, slots, r, result))

    # prefill: 4 requests x 512 new tokens from zero state (one step), and a split-invariance check
    requests, length = 4, 512
    tokens = requests * length
    xBC = torch.randn(tokens, CHANNELS, device=DEVICE).bfloat16()
    dt = torch.randn(tokens, HEADS, device=DEVICE).bfloat16()
    cu = torch.arange(0, tokens + 1, length, device=DEVICE)
    slot_ids = torch.arange(requests, device=DEVICE)

    def fresh_ours():
        conv_slots, ssm_slots = slots(requests)
        ssm_slots.zero_()
        return ours(xBC, dt, conv_slots, ssm_slots, slot_ids, cu), ssm_slots

    whole, ssm_whole = fresh_ours()
    conv_slots, ssm_slots = slots(requests)
    ssm_slots.zero_()
    pieces = []
    for lo, hi in ((0, 1), (1, 300), (300, 301), (301, length)):
        rows_of = torch.cat([torch.arange(i * length + lo, i * length + hi) for i in range(requests)]).to(DEVICE)
        piece_cu = torch.arange(0, requests * (hi - lo) + 1, hi - lo, device=DEVICE)
        pieces.append((rows_of, ours(xBC[rows_of], dt[rows_of], conv_slots, ssm_slots, slot_ids, piece_cu)))
    split = torch.empty_like(whole)
    for rows_of, y in pieces:
        split[rows_of] = y
    checks["Mamba recurrence: one prefill == 1 + 299 + 1 + 211 token pieces, bitwise"] = torch.equal(
        split, whole
    ) and torch.equal(ssm_slots, ssm_whole)

    conv_slots, ssm_slots = slots(requests)
    fns = {"ours recurrence": (lambda: ours(xBC, dt, conv_slots, ssm_slots, slot_ids, cu), True)}
    if kernels is not None:
        backend = get_ssm_backend(DEVICE, "triton")
        A = -torch.exp(p["A_log"])

        def chunked():
            outs = []
            for i in range(requests):
                seq = slice(i * length, (i + 1) * length)
                conv_state = conv_slots[i : i + 1].clone()
                x_conv = causal_conv1d_silu(xBC[None, seq], p["conv_weight"], p["conv_bias"], conv_state)
                x, B, C = x_conv.split([HEADS * HEAD_DIM, GROUPS * STATE, GROUPS * STATE], -1)
                y, _ = backend.chunk_scan(
                    x.unflatten(-1, (HEADS, HEAD_DIM)),
                    dt[None, seq],
                    A,
                    B.unflatten(-1, (GROUPS, STATE)),
                    C.unflatten(-1, (GROUPS, STATE)),
                    128,
                    p["D"],
                    p["dt_bias"],
                    initial_state=torch.zeros(1, HEADS, HEAD_DIM, STATE, device=DEVICE),
                )
                outs.append(y)
            return outs

        got = torch.cat([y.flatten(-2)[0] for y in chunked()])
        rel = ((got.float() - whole.float()).norm() / whole.float().norm()).item()
        checks["Mamba chunked scan vs our recurrence (bf16): relative error <= 2e-2"] = rel <= 2e-2
        result["chunked_vs_recurrence_rel_err"] = rel
        fns["chunked scan (mamba-ssm)"] = (chunked, False)
    conv_loop, ssm_loop = slots(requests)
    x_loop, dt_loop = xBC.view(requests, length, CHANNELS), dt.view(requests, length, HEADS)
    fns["torch token loop"] = (lambda: _token_loop(p, x_loop, dt_loop, conv_loop, ssm_loop), False)
    loop_timer = Timer(1, 1)
    times = timer({k: v for k, v in fns.items() if k != "torch token loop"}) | loop_timer(
        {"torch token loop": fns["torch token loop"]}
    )
    row = {"requests": requests, "tokens_each": length} | {f"{k}_ms": v * 1e3 for k, v in times.items()}
    row |= {f"{k}_tokens_per_s": tokens / v for k, v in times.items()}
    result["prefill"].append(row)
    print(
        f"   prefill {requests} x {length}: "
        + "  ".join(f"{k} {v * 1e3:8.2f} ms ({tokens / v / 1e3:7.0f}k tok/s)" for k, v in times.items())
    )
    return result


# ---- 5. one decode step of the models ------------------------------------------------------
DECODE_REQUESTS, DECODE_PROMPT, BLOCK_SIZE = 64, 128, 16
HYBRID_PATTERN = "M-M-M-M*-M-M-M-M*-M-M-M-"  # the training issue's hybrid configuration


def inference_model(kind: str, pg, device, **overrides):
    """The 1.4B Llama-style GPT (24 layers, hidden 2048, 16 MHA heads, SwiGLU ffn 5504, RMSNorm,
    RoPE, vocab 50304, untied) or the hybrid model of the training issue, bf16, random weights,
    in eval mode on ``device``. ``overrides`` shrink it (the CPU smoke test)."""
    import torch.nn.functional as F

    from megatron.core.config import TransformerConfig
    from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    vocab = overrides.pop("vocab_size", 50304)
    common = dict(hidden_size=2048, num_attention_heads=16, normalization="RMSNorm", add_bias_linear=False, bf16=True)
    common["layout_invariant_init"] = False  # TP 1: initialize the local tensors directly (faster)
    torch.manual_seed(0)
    if kind == "gpt":
        settings = dict(num_layers=LAYERS, ffn_hidden_size=5504, gated_linear_unit=True, activation_func=F.silu)
        config = TransformerConfig(**(common | settings | overrides))
        model = GPTModel(
            config, get_gpt_layer_local_spec(), vocab, 1024, position_embedding_type="rope", pg_collection=pg
        )
    else:
        pattern = overrides.pop("hybrid_layer_pattern", HYBRID_PATTERN)
        settings = dict(num_layers=len(pattern), ffn_hidden_size=8192, mamba_state_dim=STATE, mamba_head_dim=HEAD_DIM)
        settings |= dict(mamba_num_groups=GROUPS, mamba_chunk_size=128)
        config = TransformerConfig(**(common | settings | overrides))
        model = HybridModel(
            config, get_hybrid_stack_local_spec(), vocab, 1024, hybrid_layer_pattern=pattern, pg_collection=pg
        )
    return model.eval().to(device)


def prefilled_context(model, device, requests: int, prompt: int, max_tokens_per_step: int = 1024):
    """A dynamic context holding ``requests`` prompts of ``prompt`` random tokens, prefilled
    through the model, each with one sampled token appended: ready for a decode step."""
    from megatron.core.inference.contexts import Capacity, DynamicInferenceContext, PageReason
    from megatron.core.inference.model_runner import model_is_hybrid, stage_cache_spec

    spec = stage_cache_spec(model, BLOCK_SIZE, 1)
    blocks_each = -(-(prompt + 8) // BLOCK_SIZE)
    hybrid = model_is_hybrid(model)
    capacity = Capacity(requests * blocks_each, requests, num_mamba_slots=requests if hybrid else 0)
    ctx = DynamicInferenceContext(
        spec,
        capacity,
        max_sequence_length=prompt + 8,
        max_tokens_per_step=max_tokens_per_step,
        is_hybrid_model=hybrid,
        device=device,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = model.vocab_size if hasattr(model, "vocab_size") else 50304
    for r in range(requests):
        ctx.add_request(r, torch.randint(0, vocab, (prompt,), generator=gen).tolist(), max_new_tokens=8)
    per_step = max(1, max_tokens_per_step // prompt)
    with torch.no_grad():
        for lo in range(0, requests, per_step):
            batch = ctx.build_step([(r, prompt) for r in range(lo, min(lo + per_step, requests))])
            model(batch.token_ids[None], batch.positions[None], inference_context=ctx)
            ctx.commit_step()
    for r in range(requests):
        ctx.append_tokens(r, [int(torch.randint(0, vocab, (1,), generator=gen))])
        ctx.ensure_token_capacity(r, prompt + 1, PageReason.DECODE_GROWTH)
    return ctx


def decode_forward(model, ctx, batch) -> torch.Tensor:
    """The model's forward over a built decode step (the step stays uncommitted, so the same
    step can be run again: it rewrites the same K/V slots; Mamba states are restored by the caller)."""
    with torch.no_grad():
        return model(batch.token_ids[None], batch.positions[None], inference_context=ctx)


def _gpu_ops_per_call(fn) -> int | None:
    """CUDA kernels and copies of one call, from the profiler (None where it cannot trace)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except RuntimeError as error:
        print(f"   (profiler unavailable: {error})")
        return None


def decode_step_section(timer: Timer, checks: dict, pg) -> dict:
    """One decode step (64 requests at 128 tokens of context) of the 1.4B GPT and of the hybrid
    model through the dynamic context: the fused ops (``megatron.core.fusions``: norms with the
    residual add, RoPE in the QKV split, SwiGLU) on Triton vs their torch reference path, in the
    batch-variant and the batch-invariant mode, eager and replayed from a CUDA graph; GPU ops per
    step; graph == eager bitwise; fused vs torch logits."""
    from megatron.core import fusions
    from megatron.core.inference import kernels

    result = {}
    for kind in ("gpt", "hybrid"):
        model = inference_model(kind, pg, DEVICE)
        ctx = prefilled_context(model, DEVICE, DECODE_REQUESTS, DECODE_PROMPT)
        batch = ctx.build_step([(r, 1) for r in range(DECODE_REQUESTS)])
        mamba_saved = (
            (ctx.mamba_slots.conv.clone(), ctx.mamba_slots.ssm.clone()) if ctx.mamba_slots is not None else None
        )

        def restore_mamba(saved=mamba_saved, ctx=ctx):
            if saved is not None:  # a decode step advances the Mamba states in place: rewind
                ctx.mamba_slots.conv.copy_(saved[0])
                ctx.mamba_slots.ssm.copy_(saved[1])

        rows, logits = [], {}
        for invariant in (False, True):
            for ops in ("torch", "triton"):
                name = f"{kind} {'invariant' if invariant else 'variant'} fusions={ops}"

                def call(invariant=invariant, ops=ops, ctx=ctx, batch=batch, model=model):
                    with fusions.fusion_backend(ops), kernels.batch_invariant(invariant):
                        return decode_forward(model, ctx, batch)

                restore_mamba()
                eager_out = call().float()
                logits[(invariant, ops)] = eager_out
                restore_mamba()
                ops_count = _gpu_ops_per_call(call)
                times = timer({"eager": (call, False)})
                try:
                    graph_times = timer({"graph": (call, True)})
                    graph_error = None
                except RuntimeError as error:  # something in the forward is not capturable
                    graph_times, graph_error = {}, f"{type(error).__name__}: {str(error).splitlines()[0]}"
                same = None
                if graph_error is None:
                    restore_mamba()
                    graph = torch.cuda.CUDAGraph()
                    call()  # warm
                    restore_mamba()
                    with torch.cuda.graph(graph):
                        captured = call()
                    restore_mamba()
                    graph.replay()
                    same = torch.equal(captured.float(), eager_out)
                    if invariant:  # every kernel ours; batch-variant mode has cuBLAS pick per capture
                        checks[f"decode step {name}: graph replay == eager, bitwise"] = same
                row = {
                    "model": kind,
                    "mode": "invariant" if invariant else "variant",
                    "fusions": ops,
                    "gpu_ops_per_step": ops_count,
                    "eager_ms": times["eager"] * 1e3,
                    "graph_ms": graph_times["graph"] * 1e3 if graph_times else None,
                    "graph_error": graph_error,
                    "graph_equals_eager_bitwise": same,
                    "tokens_per_s_graph": DECODE_REQUESTS / graph_times["graph"] if graph_times else None,
                }
                rows.append(row)
                ops_text = "?" if ops_count is None else str(ops_count)
                print(
                    f"   {name:36s} {ops_text:>5} GPU ops  eager {row['eager_ms']:7.2f} ms  "
                    + (f"graph {row['graph_ms']:7.2f} ms" if graph_times else f"graph failed: {graph_error}")
                    + (f"  graph == eager: {same}" if same is not None else "")
                )
        for invariant in (False, True):
            want, got = logits[(invariant, "torch")], logits[(invariant, "triton")]
            rel = ((got - want).abs().max() / want.abs().max()).item()
            checks[
                f"decode step {kind} ({'invariant' if invariant else 'variant'}): fused vs torch ops logits, "
                "max diff <= 5% of max |logit|"
            ] = bool(torch.isfinite(got).all()) and rel <= 5e-2
            result[f"{kind}_{'invariant' if invariant else 'variant'}_fused_vs_torch_rel_diff"] = rel
        result[kind] = rows
        del model, ctx, batch
        torch.cuda.empty_cache()
    return result


def decode_step_with_groups(timer: Timer, checks: dict) -> dict:
    """Section 5 inside a world of one process (the models take its groups)."""
    from megatron.core import parallel_state

    parallel_state.initialize_distributed("nccl")
    try:
        return decode_step_section(timer, checks, parallel_state.initialize_model_parallel())
    finally:
        parallel_state.destroy_distributed()


def run(args) -> int:
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure (run this on a GPU machine)")
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton does not import (pip install triton): nothing to measure")
        return 2
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    timer = Timer(args.calls, args.trials)
    checks: dict[str, bool] = {}
    copy_bw = copy_bandwidth(timer)
    print(f"0. device-to-device copy of 1 GiB: {copy_bw / 1e9:.0f} GB/s (read + write)")
    results = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9, "checks": checks}
    sections = [
        (
            "attention",
            "1. paged decode attention (bf16, blocks of 16, head dim 128, NaN in every unwritten slot)",
            lambda: attention_section(timer, copy_bw, checks),
        ),
        (
            "gemm",
            "2. batch-invariant GEMM vs cuBLAS (bf16), the 1.4B model's linears",
            lambda: gemm_section(timer, copy_bw, checks),
        ),
        ("log_softmax", "3. per-row log-softmax [M, 50304]", lambda: log_softmax_section(timer, checks)),
        (
            "mamba",
            "4. Mamba mixer kernels (64 heads x 64, 8 groups, state 128; bf16 inputs, fp32 states)",
            lambda: mamba_section(timer, copy_bw, checks),
        ),
        (
            "decode_step",
            "5. one decode step, 64 requests x 128 context: fused ops (Triton) vs their torch path",
            lambda: decode_step_with_groups(timer, checks),
        ),
    ]
    for key, title, section in sections:
        print(title)
        try:
            results[key] = section()
        except Exception as error:  # a broken section is reported; the others still run
            traceback.print_exc()
            results[key] = {"error": f"{type(error).__name__}: {error}"}
            checks[f"section {key} ran"] = False
        write_report(results, args.json)  # after every section: a later crash keeps the numbers
    for name, ok in checks.items():
        print(f"   check {name}: {'ok' if ok else 'FAILED'}")
    print(f"wrote {args.json}; " + ("all checks passed" if all(checks.values()) else "SOME CHECKS FAILED"))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(run(_parse_args(sys.argv[1:])))
