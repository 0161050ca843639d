"""GPU benchmark and check (not a test) of the Mamba-2 mixer's training path: the torch reference
path ("reference") against the fused Triton path ("fast": our conv1d + SiLU and gated-RMSNorm
kernels around mamba-ssm's chunked-scan passes, one autograd Function), at the hybrid 1.3B shapes
(hidden 2048, 64 heads x 64, 8 groups, state 128, batch 8 x seq 2048, bf16).

    python -m benchmarks.mamba_kernels_gpu [--json mamba_kernels_gpu.json]   (from the repo root)

1. Accuracy: relative error ``|got - want| / |want|`` (Frobenius norms) of the bf16 fast and
   reference paths against the fp32 reference path on the same weights, for the mixer output,
   the input gradient and every parameter gradient; and of the Triton prefill + decode outputs
   against the fused whole-sequence output.
2. Pieces, forward and forward+backward, reference vs fast: in_proj (the same GEMM in both: its
   two columns show the timing noise), conv + SiLU, SSD scan, gated RMSNorm, out_proj (the
   reference hands it a transposed view, the fast path a contiguous tensor).
3. The fast scan's forward+backward at several chunk sizes.
4. Layers, forward+backward: a Mamba layer (norm, mixer, residual) on each path against the
   hybrid's attention layer + MLP layer pair: ms, TFLOP/s, and the per-FLOP ratio of the Mamba
   layer to the pair. FLOPs per token: 6 x the weights of every matrix, plus causal attention
   (6 x s x h), plus the SSD scan's matmuls (:meth:`MambaDims.scan_flops_per_token`).

Times are medians over trials in which the compared functions alternate. All numbers go to the
JSON file. Exits with status 2 (and says why) where CUDA or the mamba-ssm kernels are missing, and
1 when a fast-path error exceeds 1e-2 and twice the reference path's. Safe to import anywhere:
nothing runs at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.core.benchmark_report import write_report

TOLERANCE = 1e-2
DEVICE = torch.device("cuda")


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--attention-heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--iters", type=int, default=5, help="calls per timed trial")
    p.add_argument("--trials", type=int, default=3, help="alternating trials per comparison (median)")
    p.add_argument("--json", default="mamba_kernels_gpu.json", help="where to write the results")
    return p.parse_args(argv)


def median_ms(fns: dict[str, Callable[[], object]], iters: int, trials: int) -> dict[str, float]:
    """Median over ``trials`` of each function's mean ms per call over ``iters`` calls (CUDA
    events); within a trial the functions alternate. One warm-up call each first."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    return {name: statistics.median(times) for name, times in samples.items()}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _grads_of(out: torch.Tensor, leaves: list[torch.Tensor], grad_out: torch.Tensor):
    return torch.autograd.grad(out, leaves, grad_out)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


class _States:
    """A one-layer MambaInferenceContext over fresh zero states."""

    def __init__(self, dims, batch, device):
        self.conv_state = torch.zeros(batch, *dims.conv_state_shape(), device=device, dtype=torch.bfloat16)
        self.ssm_state = torch.zeros(batch, *dims.ssm_state_shape(), device=device, dtype=torch.float32)
        self.decode = False

    def is_decode_only(self):
        return self.decode

    def mamba_states(self, layer_number):
        return self.conv_state, self.ssm_state


def _accuracy(mixer, h, grad_out, decode_steps) -> dict:
    """Errors of the bf16 fast and reference paths against the fp32 reference path."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    fp32 = dataclasses.replace(mixer.config, bf16=False, params_dtype=torch.float32)
    oracle = MambaMixer(fp32, layer_number=1, pg_collection=mixer.pg_collection, ssm_backend="torch").to(DEVICE)
    oracle.load_state_dict(mixer.state_dict())
    grads = {}
    for name, module, backend, dtype in (
        ("fast", mixer, "triton", torch.bfloat16),
        ("reference", mixer, "torch", torch.bfloat16),
        ("oracle", oracle, "torch", torch.float32),
    ):
        module.ssm_backend = backend
        xin = h.to(dtype).requires_grad_(True)
        params = dict(module.named_parameters())
        out, _ = module(xin)
        values = _grads_of(out, [xin, *params.values()], grad_out.to(dtype))
        grads[name] = {"out": out.detach(), "input grad": values[0]} | dict(zip(params, values[1:], strict=True))
        del out, values
    errors = {
        key: {path: rel_err(grads[path][key], want) for path in ("fast", "reference")}
        for key, want in grads["oracle"].items()
    }
    del oracle, grads
    mixer.ssm_backend = "triton"
    with torch.no_grad():
        full, _ = mixer(h)
        ctx = _States(mixer.dims, h.shape[1], h.device)
        prefix = h.shape[0] - decode_steps
        parts = [mixer(h[:prefix], inference_context=ctx)[0]]
        ctx.decode = True
        parts += [mixer(h[t : t + 1], inference_context=ctx)[0] for t in range(prefix, h.shape[0])]
    errors["prefill + decode vs fused"] = {"fast": rel_err(torch.cat(parts), full)}
    return errors


def _pieces(mixer, kernels, h, chunk, iters, trials) -> dict:
    """Forward and forward+backward of each piece of the mixer, reference vs fast."""
    from megatron.core.ssm.backends import TorchSSMBackend
    from megatron.core.ssm.conv1d_triton import conv1d_silu_backward, conv1d_silu_forward
    from megatron.core.ssm.gated_norm_triton import gated_rms_norm_backward, gated_rms_norm_forward
    from megatron.core.ssm.mixer_reference import causal_conv1d_silu, gated_rms_norm

    dims, w, scan, torch_scan = mixer.dims, mixer.weights(), kernels.scan, TorchSSMBackend().chunk_scan
    group, eps = dims.norm_group_size, mixer.norm.eps
    with torch.no_grad():
        zxbcdt = mixer.in_proj(h)[0]
        z, xBC, dt = dims.split_in_proj(zxbcdt.transpose(0, 1))
        xBC_conv = conv1d_silu_forward(xBC, w.conv_weight, w.conv_bias)
        x, B, C = dims.split_conv(xBC_conv)
        A, D, dt_bias = w.A.detach(), w.D.detach(), w.dt_bias.detach()
        y = scan.forward(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)[0]
        y_sb, z_sb = y.flatten(-2).transpose(0, 1), z.transpose(0, 1)  # [s, b, d] views, as the fused path
        normed_fast = gated_rms_norm_forward(y_sb, z_sb, w.norm_weight, group, eps)
        normed_ref = gated_rms_norm(y.flatten(-2), z, w.norm_weight, group, eps).transpose(0, 1)

    g = torch.Generator(device=DEVICE).manual_seed(7)

    def like(t):
        return torch.randn(t.shape, device=DEVICE, dtype=t.dtype, generator=g)

    g_zx, g_xbc, g_y, g_norm, g_out = like(zxbcdt), like(xBC_conv), like(y), like(normed_fast), like(h)
    h_leaf, zx_leaf = _leaf(h), _leaf(zxbcdt)
    conv_params = [w.conv_weight, w.conv_bias]
    scan_leaves = [_leaf(t) for t in (x, dt, A, B, C, D, dt_bias)]
    y_leaf, norm_in_ref = _leaf(y.flatten(-2)), _leaf(normed_ref)

    def conv_ref_step():
        out = causal_conv1d_silu(dims.split_in_proj(zx_leaf.transpose(0, 1))[1], *conv_params)
        _grads_of(out, [zx_leaf, *conv_params], g_xbc)

    def conv_fast_step():
        conv1d_silu_forward(xBC, *conv_params)
        conv1d_silu_backward(xBC, *conv_params, g_xbc)

    def scan_ref_step():
        xs, dts, As, Bs, Cs, Ds, dtbs = scan_leaves
        out, _ = torch_scan(xs, dts, As, Bs, Cs, chunk, Ds, dtbs)
        _grads_of(out, scan_leaves, g_y)

    def scan_fast_step():
        out = scan.forward(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)[0]
        scan.backward(g_y, x, dt, A, B, C, out, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)

    def norm_ref_step():
        z_view = dims.split_in_proj(zx_leaf.transpose(0, 1))[0]
        out = gated_rms_norm(y_leaf, z_view, w.norm_weight, group, eps)
        _grads_of(out, [y_leaf, zx_leaf, w.norm_weight], g_norm.transpose(0, 1))

    def norm_fast_step():
        gated_rms_norm_forward(y_sb, z_sb, w.norm_weight, group, eps)
        gated_rms_norm_backward(y_sb, z_sb, w.norm_weight, g_norm, group, eps)

    def linear_step(layer, inp, grad):
        out, _ = layer(inp)
        _grads_of(out, [inp, layer.weight], grad)

    norm_in_fast = _leaf(normed_fast)
    cases = {
        "in_proj": (
            lambda: mixer.in_proj(h),
            lambda: mixer.in_proj(h),
            lambda: linear_step(mixer.in_proj, h_leaf, g_zx),
            lambda: linear_step(mixer.in_proj, h_leaf, g_zx),
        ),
        "conv + silu": (
            lambda: causal_conv1d_silu(xBC, *conv_params),
            lambda: conv1d_silu_forward(xBC, *conv_params),
            conv_ref_step,
            conv_fast_step,
        ),
        "ssd scan": (
            lambda: torch_scan(x, dt, A, B, C, chunk, D, dt_bias),
            lambda: scan.forward(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True),
            scan_ref_step,
            scan_fast_step,
        ),
        "gated rmsnorm": (
            lambda: gated_rms_norm(y.flatten(-2), z, w.norm_weight, group, eps),
            lambda: gated_rms_norm_forward(y_sb, z_sb, w.norm_weight, group, eps),
            norm_ref_step,
            norm_fast_step,
        ),
        "out_proj": (
            lambda: mixer.out_proj(normed_ref),
            lambda: mixer.out_proj(normed_fast),
            lambda: linear_step(mixer.out_proj, norm_in_ref, g_out),
            lambda: linear_step(mixer.out_proj, norm_in_fast, g_out),
        ),
    }
    results = {}
    for name, (ref_fwd, fast_fwd, ref_step, fast_step) in cases.items():
        with torch.no_grad():
            fwd = median_ms({"reference": ref_fwd, "fast": fast_fwd}, iters, trials)
        step = median_ms({"reference": ref_step, "fast": fast_step}, iters, trials)
        results[name] = {"forward": fwd, "forward_backward": step}
    return results


def _scan_chunks(mixer, kernels, h, iters, trials) -> dict:
    """The fast scan's forward+backward ms at several chunk sizes (the scan's blocking)."""
    from megatron.core.ssm.conv1d_triton import conv1d_silu_forward

    dims, w, scan = mixer.dims, mixer.weights(), kernels.scan
    with torch.no_grad():
        _, xBC, dt = dims.split_in_proj(mixer.in_proj(h)[0].transpose(0, 1))
        x, B, C = dims.split_conv(conv1d_silu_forward(xBC, w.conv_weight, w.conv_bias))
        A, D, dt_bias = w.A, w.D, w.dt_bias
        dy = torch.randn_like(x)

    def step(chunk):
        def run():
            out = scan.forward(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)[0]
            scan.backward(dy, x, dt, A, B, C, out, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)

        return run

    with torch.no_grad():
        return median_ms({str(chunk): step(chunk) for chunk in (16, 64, 128, 256)}, iters, trials)


def _layers(config, pg, mamba_layer, h, chunk, iters, trials) -> dict:
    """Forward+backward ms and TFLOP/s of the Mamba layer (both paths) and an attention + MLP pair."""
    from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
    from megatron.core.transformer.spec import build_module

    spec = get_hybrid_stack_local_spec().submodules
    attention = build_module(spec.attention_layer, config=config, layer_number=2, pg_collection=pg).to(DEVICE)
    mlp = build_module(spec.mlp_layer, config=config, layer_number=3, pg_collection=pg).to(DEVICE)
    seq, batch, hidden = h.shape
    mixer = mamba_layer.mixer

    def matrix_weights(*modules):
        return sum(p.numel() for m in modules for p in m.parameters() if p.dim() == 2)

    mamba_flops = 6 * (mixer.in_proj.weight.numel() + mixer.out_proj.weight.numel())
    mamba_flops += mixer.dims.scan_flops_per_token(chunk)
    pair_flops = 6 * matrix_weights(attention, mlp) + 6 * seq * hidden
    grad_out = torch.randn_like(h)

    def step(forward, modules):
        leaves = [_leaf(h)] + [p for m in modules for p in m.parameters()]

        def run():
            _grads_of(forward(leaves[0]), leaves, grad_out)

        return run

    def mamba_on(backend):
        def forward(x):
            mixer.ssm_backend = backend
            return mamba_layer(x)

        return forward

    times = median_ms(
        {
            "mamba reference": step(mamba_on("torch"), [mamba_layer]),
            "mamba fast": step(mamba_on("triton"), [mamba_layer]),
            "attention + mlp": step(lambda x: mlp(attention(x)), [attention, mlp]),
        },
        iters,
        trials,
    )
    tokens = seq * batch
    flops = {"mamba reference": mamba_flops, "mamba fast": mamba_flops, "attention + mlp": pair_flops}
    results = {
        name: {"ms": ms, "flops_per_token": flops[name], "tflops": flops[name] * tokens / (ms * 1e-3) / 1e12}
        for name, ms in times.items()
    }
    pair = results["attention + mlp"]["tflops"]
    for name in ("mamba reference", "mamba fast"):
        results[name]["per_flop_vs_pair"] = results[name]["tflops"] / pair
    return results


def _print_report(args, report) -> None:
    print(
        f"Mamba mixer: hidden {args.hidden}, heads {report['config']['heads']}x{args.head_dim}, groups {args.groups}, "
        f"state {args.state}, chunk {args.chunk}; batch {args.batch} x seq {args.seq}; bf16"
    )
    print("accuracy (relative error vs the fp32 reference path):")
    for key, errs in report["accuracy"].items():
        cols = "  ".join(f"{path} {err:.2e}" for path, err in errs.items())
        print(f"  {key:26s} {cols}")
    print("pieces (median ms; speed-up = reference / fast):")
    for name, modes in report["pieces"].items():
        for mode, t in modes.items():
            ref, fast = t["reference"], t["fast"]
            print(f"  {name:14s} {mode:16s} reference {ref:8.3f}   fast {fast:8.3f}   speed-up {ref / fast:6.2f}x")
    print(
        "fast scan forward+backward by chunk size (ms): "
        + "  ".join(f"{k}: {v:.3f}" for k, v in report["scan_chunks"].items())
    )
    print("layers, forward+backward:")
    for name, r in report["layers"].items():
        ratio = f"   per FLOP vs attention + mlp {r['per_flop_vs_pair']:.2f}x" if "per_flop_vs_pair" in r else ""
        print(f"  {name:16s} {r['ms']:8.2f} ms   {r['tflops']:6.1f} TFLOP/s{ratio}")


def run(args) -> int:
    from megatron.core.config import TransformerConfig
    from megatron.core.process_groups import ProcessGroupCollection, RankLayout
    from megatron.core.ssm.backends import load_mamba_kernels, triton_chunk_size
    from megatron.core.ssm.mamba_layer import MambaLayer

    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to compare (run this on a GPU machine)")
        return 2
    kernels = load_mamba_kernels()
    if kernels is None:
        print("mamba_ssm or Triton kernels did not import (install the mamba-ssm wheel): nothing to compare")
        return 2
    started = time.perf_counter()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.attention_heads,
        ffn_hidden_size=args.ffn,
        bf16=True,
        add_bias_linear=False,
        mamba_head_dim=args.head_dim,
        mamba_num_groups=args.groups,
        mamba_state_dim=args.state,
        mamba_chunk_size=args.chunk,
    )
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            pg = ProcessGroupCollection.from_layout(RankLayout())
            torch.manual_seed(0)
            layer = MambaLayer(config, layer_number=1, pg_collection=pg).to(DEVICE)
            g = torch.Generator(device=DEVICE).manual_seed(0)
            h = torch.randn(args.seq, args.batch, args.hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
            grad_out = torch.randn(h.shape, device=DEVICE, dtype=torch.bfloat16, generator=g)
            chunk = triton_chunk_size(args.chunk)
            report = {"config": vars(args) | {"heads": layer.mixer.dims.nheads, "scan_chunk": chunk}}
            report["accuracy"] = _accuracy(layer.mixer, h, grad_out, args.decode_steps)
            report["pieces"] = _pieces(layer.mixer, kernels, h, chunk, args.iters, args.trials)
            report["scan_chunks"] = _scan_chunks(layer.mixer, kernels, h, args.iters, args.trials)
            report["layers"] = _layers(config, pg, layer, h, chunk, args.iters, args.trials)
        finally:
            dist.destroy_process_group()
    report["elapsed_s"] = time.perf_counter() - started
    _print_report(args, report)
    write_report(report, args.json)
    print(f"wrote {args.json} ({report['elapsed_s']:.0f} s)")
    failed = [
        key
        for key, errs in report["accuracy"].items()
        if errs["fast"] > TOLERANCE and errs["fast"] > 2 * errs.get("reference", 0.0)
    ]
    if failed:
        print(f"FAILED: fast-path error above {TOLERANCE} (and twice the reference's) for: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(_parse_args(sys.argv[1:])))
