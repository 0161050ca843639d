#!/usr/bin/env python3
"""GPU check and benchmark (not a test) of the training kernels of issue 15 at the GPT-2 1.32B
shapes (bf16, 16384 tokens = micro-batch 8 x seq 2048, hidden 2048, ffn 8192, vocab 50304):

    python benchmarks/fused_kernels_gpu.py [--output-json fused_kernels.json]

- ``linear_cross_entropy``: the fused output layer + loss
  (:mod:`megatron.core.fusions.linear_cross_entropy`, the logits never materialized) against our
  logits path (the output GEMM, then the Triton vocab-parallel cross-entropy), torch eager
  (``F.linear`` + ``F.cross_entropy`` of fp32 logits, what autocast does) and that torch code
  ``torch.compile``-d; forward + backward of the masked-mean loss, peak memory above the inputs.
- ``gelu_bias_backward`` [16384, 8192] and ``swiglu_backward`` [16384, 2 x 8192]: the activation
  backward kernel against ``aten.gelu_backward`` / the SiLU-gate ops (+ the bias sum) eager and
  compiled; achieved bandwidth of the three tensor passes.
- ``layernorm_residual_fwd_bwd`` [16384, 2048]: a layer input's LayerNorm forward and the
  gradient of that input (the norm's input gradient plus the residual's, one backward kernel:
  ``norm_and_residual``) against LayerNorm + autograd's add, eager and compiled.

Each op is first checked against an fp32 torch reference on the same inputs (max relative error
of outputs and gradients, ``ok`` under 3e-2 for bf16). Times are medians of alternating trials
(CUDA events), ratios are torch / ours (> 1: ours faster). Exits with status 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

TOKENS, HIDDEN, FFN, VOCAB = 16384, 2048, 8192, 50304
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _time_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def alternating_ms(variants: dict, trials: int, warmup: int = 2) -> dict:
    """Median ms per call of each variant, the variants alternating trial by trial."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in variants}
    for _ in range(trials):
        for name, fn in variants.items():
            times[name].append(_time_ms(fn))
    return {name: round(statistics.median(t), 3) for name, t in times.items()}


def peak_mib(fn) -> float:
    """Peak memory of one call above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)).item()


def _check(pairs, tolerance: float = 3e-2) -> dict:
    errors = {name: round(rel_err(got, want), 6) for name, (got, want) in pairs.items()}
    return {"max_rel_err": errors, "ok": max(errors.values()) < tolerance}


# --------------------------------------------------------------------------- linear cross-entropy


def linear_cross_entropy_case(trials: int) -> dict:
    from megatron.core.fusions import fusion_backend, vocab_parallel_cross_entropy
    from megatron.core.fusions.linear_cross_entropy import linear_cross_entropy

    group = torch.distributed.group.WORLD  # a world of one
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device=DEVICE, generator=gen).to(DTYPE).requires_grad_()
    weight = (0.02 * torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=gen)).to(DTYPE).requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), device=DEVICE, generator=gen)
    mask = (torch.rand(TOKENS, device=DEVICE, generator=gen) > 0.1).float()

    def masked_mean(loss):
        return (loss * mask).sum() / mask.sum()

    def fused():
        with fusion_backend("triton"):
            return masked_mean(linear_cross_entropy(hidden, weight, target, group, token_weight=mask))

    def logits_path():
        with fusion_backend("triton"):
            return masked_mean(vocab_parallel_cross_entropy(F.linear(hidden, weight), target, group))

    def torch_loss(h, w):
        logits = F.linear(h, w).float()
        return (F.cross_entropy(logits, target, reduction="none") * mask).sum() / mask.sum()

    compiled_loss = torch.compile(torch_loss)

    def step(loss_fn):
        def run():
            hidden.grad = weight.grad = None
            loss_fn().backward()

        return run

    variants = {
        "ours_fused": step(fused),
        "ours_logits": step(logits_path),
        "torch": step(lambda: torch_loss(hidden, weight)),
        "torch_compiled": step(lambda: compiled_loss(hidden, weight)),
    }
    results = {}
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    reference = torch_loss(h32, w32)
    reference.backward()
    for name in ("ours_fused", "ours_logits"):
        hidden.grad = weight.grad = None
        loss = fused() if name == "ours_fused" else logits_path()
        loss.backward()
        results[f"check_{name}"] = _check(
            {
                "loss": (loss.detach(), reference.detach()),
                "d_hidden": (hidden.grad, h32.grad),
                "d_weight": (weight.grad, w32.grad),
            }
        )
    results["ms"] = alternating_ms(variants, trials)
    results["peak_mib"] = {name: peak_mib(fn) for name, fn in variants.items()}
    ms = results["ms"]
    results["ratios"] = {
        f"{base}/ours_fused": round(ms[base] / ms["ours_fused"], 3)
        for base in ("ours_logits", "torch", "torch_compiled")
    }
    return results


# --------------------------------------------------------------------------- activation backward


def activation_backward_case(gated: bool, trials: int) -> dict:
    from megatron.core.fusions.activations_triton import activation_backward

    n_cols = FFN
    in_cols = 2 * n_cols if gated else n_cols
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = (2 * torch.randn(TOKENS, in_cols, device=DEVICE, generator=gen)).to(DTYPE)
    dy = torch.randn(TOKENS, n_cols, device=DEVICE, generator=gen).to(DTYPE)
    bias = None if gated else torch.randn(in_cols, device=DEVICE, generator=gen).to(DTYPE)
    act = "silu" if gated else "gelu"

    def ours():
        return activation_backward(dy, x, bias, act, gated)

    def torch_backward(dy, x, bias):
        if gated:
            gate, up = x.chunk(2, dim=-1)
            silu = F.silu(gate)
            d_gate = torch.ops.aten.silu_backward(dy * up, gate)
            return torch.cat([d_gate, dy * silu], dim=-1), None
        dx = torch.ops.aten.gelu_backward(dy, x + bias)
        return dx, dx.sum(0, dtype=torch.float32).to(bias.dtype)

    compiled = torch.compile(torch_backward)
    # fp32 reference of the same inputs
    x32 = x.float().requires_grad_()
    b32 = None if bias is None else bias.float().requires_grad_()
    if gated:
        gate, up = x32.chunk(2, dim=-1)
        out = F.silu(gate) * up
    else:
        out = F.gelu(x32 + b32)
    out.backward(dy.float())
    dx, dbias = ours()
    pairs = {"d_x": (dx, x32.grad)}
    if bias is not None:
        pairs["d_bias"] = (dbias, b32.grad)
    results = {"check": _check(pairs)}
    results["ms"] = alternating_ms(
        {"ours": ours, "torch": lambda: torch_backward(dy, x, bias), "torch_compiled": lambda: compiled(dy, x, bias)},
        trials,
    )
    passes_bytes = (dy.numel() + 2 * x.numel()) * x.element_size()  # read dy and x, write dx
    results["ours_gb_per_s"] = round(passes_bytes / (results["ms"]["ours"] * 1e-3) / 1e9, 1)
    ms = results["ms"]
    results["ratios"] = {f"{base}/ours": round(ms[base] / ms["ours"], 3) for base in ("torch", "torch_compiled")}
    return results


# --------------------------------------------------------------------------- norm + residual backward


def norm_residual_backward_case(trials: int) -> dict:
    """The layer input's gradient: the input LayerNorm's input gradient plus the residual's, with
    the weight and bias gradients; ours in one kernel (norm_and_residual), torch as LayerNorm's
    backward then autograd's add."""
    from megatron.core.fusions import fusion_backend
    from megatron.core.fusions.norms import norm_and_residual

    gen = torch.Generator(device=DEVICE).manual_seed(2)
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE, generator=gen).to(DTYPE).requires_grad_()
    weight = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE, generator=gen)).to(DTYPE).requires_grad_()
    bias = (0.1 * torch.randn(HIDDEN, device=DEVICE, generator=gen)).to(DTYPE).requires_grad_()
    d_residual, d_out = (torch.randn(TOKENS, HIDDEN, device=DEVICE, generator=gen).to(DTYPE) for _ in range(2))

    def ours():
        with fusion_backend("triton"):
            residual, out = norm_and_residual(x, weight, bias, 1e-5, "LayerNorm")
        return torch.autograd.grad([residual, out], [x, weight, bias], [d_residual, d_out])

    def torch_grads(x, weight, bias, d_residual, d_out):
        out = F.layer_norm(x, (HIDDEN,), weight, bias, 1e-5)
        dx, dw, db = torch.autograd.grad(out, [x, weight, bias], d_out)
        return dx + d_residual, dw, db

    compiled = torch.compile(torch_grads)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, weight, bias))
    want = torch_grads(x32, w32, b32, d_residual.float(), d_out.float())
    got = ours()
    names = ("d_x", "d_weight", "d_bias")
    results = {"check": _check({name: (g, w) for name, g, w in zip(names, got, want, strict=True)})}
    results["ms"] = alternating_ms(
        {
            "ours": ours,
            "torch": lambda: torch_grads(x, weight, bias, d_residual, d_out),
            "torch_compiled": lambda: compiled(x, weight, bias, d_residual, d_out),
        },
        trials,
    )
    ms = results["ms"]
    results["ratios"] = {f"{base}/ours": round(ms[base] / ms["ours"], 3) for base in ("torch", "torch_compiled")}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--output-json", default=None)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_kernels_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    from megatron.core.parallel_state import initialize_distributed

    initialize_distributed("nccl")  # a world of one: the cross-entropy ops take a TP group
    props = torch.cuda.get_device_properties(0)
    report = {
        "gpu": props.name,
        "torch": torch.__version__,
        "shapes": dict(tokens=TOKENS, hidden=HIDDEN, ffn=FFN, vocab=VOCAB),
    }
    cases = {
        "gelu_bias_backward": lambda: activation_backward_case(False, opts.trials),
        "swiglu_backward": lambda: activation_backward_case(True, opts.trials),
        "layernorm_residual_fwd_bwd": lambda: norm_residual_backward_case(opts.trials),
        "linear_cross_entropy": lambda: linear_cross_entropy_case(opts.trials),
    }
    for name, case in cases.items():
        try:
            report[name] = case()
        except Exception as error:  # one case failing still leaves the others' numbers
            report[name] = {"error": f"{type(error).__name__}: {error}"[:600]}
        print(f"{name}: {json.dumps(report[name])}", flush=True)
        torch.cuda.empty_cache()
        if opts.output_json:
            with open(opts.output_json, "w") as f:
                json.dump(report, f, indent=2)
    return 0 if all_checks_pass(report, cases) else 1


def all_checks_pass(report: dict, cases) -> bool:
    """Every case ran and every one of its checks is within tolerance."""
    for name in cases:
        result = report[name]
        if "error" in result or not all(v["ok"] for k, v in result.items() if k.startswith("check")):
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
