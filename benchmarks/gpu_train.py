#!/usr/bin/env python3
"""Training speed on one GPU: our GPT / hybrid pretraining train step against a plain
PyTorch loop of the same model, eager and ``torch.compile``-d, in the same process.

    python benchmarks/gpu_train.py [--config gpt2|llama|hybrid|all] [--quick] [--output-json out.json]

Configurations (bf16, seq 2048, micro-batch 8, mock data, AdamW, grad clipping 1.0, no dropout):

- gpt2: 24 layers, hidden 2048, 16 heads, ffn 8192, vocab 50304, LayerNorm, GeLU, learned
  positions, biases, tied embeddings (1.32B);
- llama: the same trunk with RMSNorm, SwiGLU ffn 5504, RoPE, GQA 16/4, no biases, untied (1.3B);
- hybrid: ``M-M-M-M*-M-M-M-M*-M-M-M-`` (Mamba-2 state 128, head dim 64, 8 groups, chunk 128;
  attention 16 heads; MLP ffn 8192), RMSNorm, no biases, untied.

"ours" is :class:`megatron.training.training.Trainer` built from the flags as
``megatron-pretrain-gpt`` / ``megatron-pretrain-hybrid`` build it, stepped through
``Trainer.train_step`` (its attention takes the SDPA kernels of ``--attention-backend``: by
default cuDNN first); "ours_compiled" compiles its decoder layers as ``--use-torch-compile`` does
(the same SDPA kernels inside them: the backend context is traced). "plain" is the simplest
fast loop: fp32 parameters, SDPA with its own kernel choice, ``autocast(bf16)``, fused AdamW,
``clip_grad_norm_``, and (compiled) ``torch.compile`` of the whole model. Variants run in
alternating trials; the median step time gives tokens/s and TFLOP/s (every variant by the one
FLOPs formula, :func:`megatron.training.metrics.training_flops_per_token`), and each ratio ours / plain comes
from the trials of the alternation the two ran in together. Each configuration also reports
peak memory, a forward/backward/optimizer split, which fused kernels and attention backend were
active, the attention kernel's time per SDPA backend and layout, and one profiled step's GPU busy
time and top CUDA kernels. Before any configuration runs, every fused kernel is checked against its torch reference
on the GPU; a kernel that fails is switched off (reported), so the numbers still come.

A failure in one configuration or variant is recorded in the JSON and the rest still runs; a
time budget (``--budget-s``) drops optional work (our compiled variant, profiles) when short.
Both loops' models, optimizer states and activations share one card: the allocator runs with
expandable segments (``PYTORCH_CUDA_ALLOC_CONF``, unless already set), without which the llama
configuration's plain loop ran out of memory on an 80 GB H100 with 3.7 GiB reserved but unusable.
A configuration whose two loops still do not fit together runs again one loop at a time (ours,
then the plain loop eager and compiled; no alternation, profiles or ours_compiled), and its JSON
says so (``mode``, ``sequential_because``); ``--sequential`` asks for that from the start.

Exits with status 2 where CUDA is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

SEQ, MICRO_BATCH, VOCAB = 2048, 8, 50304
LAYERS, HIDDEN, HEADS = 24, 2048, 16
HYBRID_PATTERN = "M-M-M-M*-M-M-M-M*-M-M-M-"
MAMBA = dict(state=128, head_dim=64, groups=8, chunk=128)


def common_flags() -> list[str]:
    """Our flags shared by the configurations (from the module's size constants)."""
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(MICRO_BATCH),
        "--train-iters", "100000", "--lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
        "--weight-decay", "0.01", "--bf16", "--mock-data", "--vocab-size", str(VOCAB), "--log-interval", "1000000000",
        # The plain loop has no dropout: the same model here means none either (Megatron's default is 0.1).
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    ]  # fmt: skip


CONFIGS = {
    "gpt2": {
        "family": "gpt",
        "flags": ["--ffn-hidden-size", "8192"],
        "plain": dict(norm="layer", act="gelu", rope=False, bias=True, tied=True, groups=16, ffn=8192),
    },
    "llama": {
        "family": "gpt",
        "flags": [
            "--ffn-hidden-size",
            "5504",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--position-embedding-type",
            "rope",
            "--num-query-groups",
            "4",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
        ],  # fmt: skip
        "plain": dict(norm="rms", act="swiglu", rope=True, bias=False, tied=False, groups=4, ffn=5504),
    },
    "hybrid": {
        "family": "hybrid",
        "flags": [
            "--hybrid-layer-pattern",
            HYBRID_PATTERN,
            "--ffn-hidden-size",
            "8192",
            "--normalization",
            "RMSNorm",
            "--mamba-state-dim",
            str(MAMBA["state"]),
            "--mamba-head-dim",
            str(MAMBA["head_dim"]),
            "--mamba-num-groups",
            str(MAMBA["groups"]),
            "--mamba-chunk-size",
            str(MAMBA["chunk"]),
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
        ],  # fmt: skip
        "plain": dict(norm="rms", act="gelu", rope=False, bias=False, tied=False, groups=16, ffn=8192),
    },
}


# --------------------------------------------------------------------------- plain models


class PlainAttention(nn.Module):
    def __init__(self, hidden, heads, groups, bias):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * self.head_dim, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x, rope):
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            cos, sin = rope
            q, k = (t * cos + torch.cat((-t[..., d // 2 :], t[..., : d // 2]), dim=-1) * sin for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class PlainMLP(nn.Module):
    def __init__(self, hidden, ffn, act, bias):
        super().__init__()
        self.gated = act == "swiglu"
        self.fc1 = nn.Linear(hidden, 2 * ffn if self.gated else ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        h = self.fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h))


class PlainMamba2(nn.Module):
    """Mamba-2 mixer from mamba-ssm's Triton scan and gated RMSNorm; conv as a torch Conv1d."""

    def __init__(self, hidden, state, head_dim, groups, chunk, d_conv=4):
        super().__init__()
        from megatron.core.ssm.backends import load_mamba_kernels

        kernels = load_mamba_kernels()
        if kernels is None:
            raise RuntimeError("mamba-ssm's Triton kernels do not import")
        from mamba_ssm.ops.triton.layernorm_gated import RMSNorm as GatedRMSNorm

        self.scan = kernels.chunk_scan_combined
        d_inner = 2 * hidden
        self.heads, self.head_dim = d_inner // head_dim, head_dim
        self.groups, self.state, self.chunk = groups, state, chunk
        self.sizes = [d_inner, d_inner + 2 * groups * state, self.heads]
        self.in_proj = nn.Linear(hidden, sum(self.sizes), bias=False)
        conv = self.sizes[1]
        self.conv1d = nn.Conv1d(conv, conv, d_conv, groups=conv, padding=d_conv - 1)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.full((self.heads,), 0.01))))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(d_inner, group_size=d_inner // groups, norm_before_gate=False)
        self.out_proj = nn.Linear(d_inner, hidden, bias=False)

    @torch.compiler.disable
    def _ssm(self, x, dt, B, C, z):
        y = self.scan(
            x, dt, -torch.exp(self.A_log.float()), B, C, self.chunk, D=self.D, dt_bias=self.dt_bias, dt_softplus=True
        )
        return self.norm(y.flatten(-2), z)

    def forward(self, x, rope=None):
        b, s, _ = x.shape
        z, xbc, dt = self.in_proj(x).split(self.sizes, dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :s].transpose(1, 2))
        xs, B, C = xbc.split([self.sizes[0], self.groups * self.state, self.groups * self.state], dim=-1)
        y = self._ssm(
            xs.unflatten(-1, (self.heads, self.head_dim)),
            dt,
            B.unflatten(-1, (self.groups, self.state)),
            C.unflatten(-1, (self.groups, self.state)),
            z,
        )
        return self.out_proj(y)


class PlainBlock(nn.Module):
    def __init__(self, kind, hidden, cfg, heads, mamba):
        super().__init__()
        self.norm = nn.LayerNorm(hidden) if cfg["norm"] == "layer" else nn.RMSNorm(hidden, eps=1e-5)
        if kind == "attention":
            self.block = PlainAttention(hidden, heads, cfg["groups"], cfg["bias"])
        elif kind == "mlp":
            self.block = PlainMLP(hidden, cfg["ffn"], cfg["act"], cfg["bias"])
        else:
            self.block = PlainMamba2(hidden, **mamba)
        self.kind = kind

    def forward(self, x, rope):
        return x + (self.block(self.norm(x), rope) if self.kind != "mlp" else self.block(self.norm(x)))


class PlainLM(nn.Module):
    """A decoder-only LM in plain torch: a GPT (attention + MLP per layer) or a hybrid pattern."""

    def __init__(self, cfg, layers, hidden, heads, pattern=None, mamba=None):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, hidden)
        self.wpe = nn.Embedding(SEQ, hidden) if not cfg["rope"] and pattern is None else None
        kinds = (
            [{"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in pattern]
            if pattern
            else ["attention", "mlp"] * layers
        )
        self.blocks = nn.ModuleList(PlainBlock(k, hidden, cfg, heads, mamba) for k in kinds)
        self.norm = nn.LayerNorm(hidden) if cfg["norm"] == "layer" else nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        if cfg["tied"]:
            self.lm_head.weight = self.wte.weight
        self.rope = None
        if cfg["rope"]:
            d = hidden // heads
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
            angles = torch.outer(torch.arange(SEQ).float(), inv).repeat(1, 2)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
            self.rope = True

    def forward(self, tokens):
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe.weight[: tokens.shape[1]]
        rope = (self.cos, self.sin) if self.rope else None
        for block in self.blocks:
            x = block(x, rope)
        return self.lm_head(self.norm(x))


class PlainLoop:
    """The simplest fast loop: fp32 params, autocast bf16, SDPA, fused AdamW, grad clipping."""

    def __init__(self, model: nn.Module, device):
        self.model = model.to(device)
        self.step_model = self.model
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=1e-4, fused=True
        )
        gen = torch.Generator(device=device).manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), device=device, generator=gen)

    def compile(self):
        self.step_model = torch.compile(self.model)

    def forward(self):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self.step_model(self.tokens[:, :-1])
            return F.cross_entropy(logits.view(-1, VOCAB), self.tokens[:, 1:].reshape(-1))

    def optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        loss = self.forward()
        loss.backward()
        self.optimizer_step()
        return loss.item()


# --------------------------------------------------------------------------- our loop


class OurLoop:
    """Our Trainer built from the GPT / hybrid pretraining flags, stepped with train_step."""

    def __init__(self, name: str):
        from megatron.core import parallel_state
        from megatron.training.arguments import parse_args
        from megatron.training.initialize import initialize_megatron
        from megatron.training.training import Trainer

        spec = CONFIGS[name]
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        self.args = parse_args(common_flags() + spec["flags"], model_family=spec["family"], world_size=1)
        self.trainer = Trainer(self.args, initialize_megatron(self.args))
        self.iterator = self.trainer.data_iterator(self.trainer.train_ds, 0)

    def step(self) -> float:
        return self.trainer.train_step(self.iterator)[0]

    def compile(self):
        self.trainer.model.module.decoder.compile_layers()

    def phases(self):
        """One step split into (forward + loss, backward, grad finalize + optimizer) callables."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.training.training import forward_step

        trainer, state = self.trainer, {}

        def forward():
            trainer.model.zero_grad_buffer()
            trainer.optimizer.zero_grad()
            output, loss_func = forward_step(self.iterator, trainer.model)
            state["loss"] = loss_func(output)[0]

        def backward():
            state.pop("loss").backward()

        def optimizer():
            finalize_model_grads([trainer.model], trainer.pgc, trainer.config)
            trainer.optimizer.step()

        return forward, backward, optimizer


# --------------------------------------------------------------------------- measurement


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def alternating_trials(steppers: dict, trials: int, steps: int) -> dict:
    """Per variant, the mean step time (s) of each trial; variants alternate trial by trial."""
    times = {name: [] for name in steppers}
    for _ in range(trials):
        for name, step in steppers.items():
            times[name].append(_sync_time(lambda step=step: [step() for _ in range(steps)]) / steps)
    return times


def peak_memory_gib(step) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def phase_split_ms(phases) -> dict:
    """Forward / backward / optimizer milliseconds of one step (synchronized between phases)."""
    names = ("forward", "backward", "optimizer")
    return {name: round(1000 * _sync_time(fn), 2) for name, fn in zip(names, phases, strict=True)}


def plain_phases(loop: PlainLoop):
    state = {}

    def forward():
        state["loss"] = loop.forward()

    def backward():
        state.pop("loss").backward()

    return forward, backward, loop.optimizer_step


def step_profile(step, count: int = 25) -> dict:
    """One step under ``torch.profiler``: its wall and GPU busy milliseconds (the union of the
    kernels' intervals; the rest is the GPU waiting on the host), kernel launches, and
    ``[name, ms, calls]`` of the ``count`` CUDA kernels that took the most time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from megatron.core.benchmark_report import busy_us

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    totals: dict[str, list] = {}
    for e in kernels:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return {
        "wall_ms": round(1e3 * wall_s, 2),
        "gpu_busy_ms": round(busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3, 2),
        "kernel_launches": len(kernels),
        "top_kernels": [[name[:110], round(total / 1e3, 3), calls] for name, (total, calls) in top],
    }


def sdpa_probe(heads: int, groups: int, head_dim: int) -> dict:
    """Forward + backward ms of causal SDPA at the benchmark's shape per backend, and the
    backend SDPA picks, for q/k/v laid out as ours without RoPE (views of the packed
    ``[s, b, (h+2g)d]`` projection), ours with RoPE (batch-major copies) and the plain loop
    (views of the packed ``[b, s, (h+2g)d]`` projection)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def packed(seq_major: bool):
        width = (heads + 2 * groups) * head_dim
        rows = (SEQ, MICRO_BATCH) if seq_major else (MICRO_BATCH, SEQ)
        qkv = torch.randn(*rows, width, device="cuda", dtype=torch.bfloat16)
        parts = qkv.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
        views = [t.unflatten(-1, (-1, head_dim)) for t in parts]
        return [t.permute(1, 2, 0, 3) if seq_major else t.transpose(1, 2) for t in views]

    def batch_major():
        return [torch.randn(MICRO_BATCH, SEQ, n, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for n in (heads, groups, groups)]  # fmt: skip

    layouts = {
        "ours_packed_sbhd": lambda: packed(True),
        "ours_rope_bshd": batch_major,
        "plain_packed_bshd": lambda: packed(False),
    }
    gqa, result = groups != heads, {}
    for layout, make in layouts.items():
        q, k, v = (t.detach().requires_grad_() for t in make())
        entry = {}
        with contextlib.suppress(Exception):
            entry["default_choice"] = str(SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=gqa)))
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):

            def run(backend=backend, q=q, k=k, v=v):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                out.backward(torch.ones_like(out))

            try:
                run()
                entry[backend] = round(1000 * min(_sync_time(run) for _ in range(3)), 3)
            except Exception as error:  # a backend that does not take this shape or layout
                entry[backend] = f"unavailable: {type(error).__name__}"
        result[layout] = entry
    return result


# --------------------------------------------------------------------------- kernel check


def check_kernels(device) -> dict:
    """Each fused op on the GPU against its torch path (bf16, forward and backward, the widths
    and flag combinations the three configurations use, few tokens); an op that fails or
    disagrees is switched to torch for the rest of the run."""
    from megatron.core import fusions
    from megatron.core.fusions.linear_cross_entropy import linear_cross_entropy as linear_ce
    from megatron.core.transformer.rope import RotaryEmbedding

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0, grad=True):
        t = (scale * torch.randn(*shape, device=device, generator=gen)).to(torch.bfloat16)
        return t.requires_grad_(grad)

    s, b, h = 32, 2, HIDDEN
    x, res, bias, nb = randn(s, b, h), randn(s, b, h), randn(h), randn(h)
    w = (1 + randn(h, scale=0.1, grad=False)).requires_grad_()
    rot = RotaryEmbedding(HIDDEN // HEADS)(torch.arange(s, device=device).unsqueeze(0).expand(b, s))
    qkv = randn(s, b, (HEADS + 2 * CONFIGS["llama"]["plain"]["groups"]) * (HIDDEN // HEADS))
    logits, target = randn(s, b, VOCAB, scale=3.0), torch.randint(0, VOCAB, (s, b), device=device, generator=gen)
    fc1, fc1_bias, fc1_gated = randn(s, b, 8192), randn(8192), randn(s, b, 2 * CONFIGS["llama"]["plain"]["ffn"])
    out_w, mask = randn(VOCAB, h, scale=0.02), (torch.rand(s, b, device=device, generator=gen) > 0.2).float()
    groups = CONFIGS["llama"]["plain"]["groups"]
    bda_norm = fusions.bias_dropout_add_norm
    cases = [  # (name, op, call): every flag combination a configuration takes
        ("layernorm", "norm", lambda: fusions.norm(x, w, nb, 1e-5, "LayerNorm")),
        ("rmsnorm", "norm", lambda: fusions.norm(x, w, None, 1e-5, "RMSNorm")),
        ("add_layernorm", "norm", lambda: bda_norm(x, bias, res, 0.0, True, False, w, nb, 1e-5, "LayerNorm")),
        ("add_rmsnorm", "norm", lambda: bda_norm(x, None, res, 0.0, True, False, w, None, 1e-5, "RMSNorm")),
        ("bias_dropout_add", "bias_dropout_add", lambda: fusions.bias_dropout_add(x, bias, res, 0.0, True)),
        ("dropout_add", "bias_dropout_add", lambda: fusions.bias_dropout_add(x, None, res, 0.0, True)),
        ("bias_gelu", "activation", lambda: fusions.activation(fc1, fc1_bias, F.gelu, False)),
        ("gelu", "activation", lambda: fusions.activation(fc1, None, F.gelu, False)),
        ("swiglu", "activation", lambda: fusions.activation(fc1_gated, None, F.silu, True)),
        ("rope_split", "rope", lambda: fusions.split_qkv(qkv, HEADS, groups, HIDDEN // HEADS, rot)),
        ("cross_entropy", "cross_entropy", lambda: fusions.vocab_parallel_cross_entropy(logits * 1, target, None)),
        # Reduced with its loss mask, as training does: the op's gradient contract (see its module).
        (
            "linear_cross_entropy",
            "linear_cross_entropy",
            lambda: (linear_ce(x, out_w, target, None, token_weight=mask) * mask).sum(),
        ),
    ]
    leaves = [x, res, w, nb, bias, qkv, logits, fc1, fc1_bias, fc1_gated, out_w]
    report, failed = {}, []
    for name, op, call in cases:
        try:
            results = []
            for backend in ("triton", "torch"):
                for leaf in leaves:
                    leaf.grad = None
                with fusions.fusion_backend(backend):
                    out = call()
                outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
                cot = torch.Generator(device=device).manual_seed(1)
                torch.autograd.backward(
                    outs, [torch.randn(t.shape, device=device, generator=cot).to(t.dtype) for t in outs]
                )
                results.append(
                    [t.float() for t in outs] + [leaf.grad.float() for leaf in leaves if leaf.grad is not None]
                )
            fused, reference = results
            errors = [
                ((a - r).abs().max() / r.abs().max().clamp(min=1e-6)).item()
                for a, r in zip(fused, reference, strict=True)
            ]
            report[name] = {"op": op, "max_rel_err": round(max(errors), 5), "ok": max(errors) < 0.03}
        except Exception as error:
            report[name] = {"op": op, "ok": False, "error": f"{type(error).__name__}: {error}"[:400]}
        if not report[name]["ok"] and op not in failed:
            failed.append(op)
    report["adamw"] = _check_flat_adamw(device)
    if not report["adamw"]["ok"]:
        failed.append("adamw")
    fusions.set_fusion_backend(None, disabled_ops=failed)
    report["disabled_ops"] = failed
    return report


def _check_flat_adamw(device) -> dict:
    """Two steps of FlatAdamW over views of flat bf16 parameter and fp32 gradient buffers
    (two groups, a clipping factor) against torch's fused AdamW on fp32 copies; the parameters
    must be the masters rounded to bf16."""
    from megatron.core.optimizer.flat_adamw import FlatAdamW

    try:
        gen = torch.Generator(device=device).manual_seed(2)
        sizes = [HIDDEN * 3 + 5, HIDDEN, 4 * HIDDEN + 3]
        param_data = torch.randn(sum(sizes), device=device, generator=gen).to(torch.bfloat16)
        grad_data = torch.zeros(sum(sizes), device=device)
        params, grads = param_data.split(sizes), grad_data.split(sizes)
        masters = [p.float() for p in params]
        copies = [m.clone() for m in masters]

        def groups(tensors):
            return [{"params": tensors[:1], "weight_decay": 0.1}, {"params": tensors[1:], "weight_decay": 0.0}]

        flat = FlatAdamW(groups(masters), list(zip(grads, params, strict=True)), lr=1e-3, betas=(0.9, 0.95))
        reference = torch.optim.AdamW(groups(copies), lr=1e-3, betas=(0.9, 0.95), fused=True)
        for optimizer, tensors in ((flat, masters), (reference, copies)):
            for step in range(2):
                grad_data.copy_(torch.randn(grad_data.shape, device=device, generator=gen.manual_seed(step)))
                for tensor, grad in zip(tensors, grads, strict=True):
                    tensor.grad = grad
                optimizer.grad_scale = torch.full((1,), 2.0, device=device)
                optimizer.step()
        error = max(((m - c).abs().max() / c.abs().max()).item() for m, c in zip(masters, copies, strict=True))
        rounded = all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, masters, strict=True))
        ok = error < 1e-5 and rounded
        return {"op": "adamw", "max_rel_err": round(error, 7), "params_rounded": rounded, "ok": ok}
    except Exception as error:
        return {"op": "adamw", "ok": False, "error": f"{type(error).__name__}: {error}"[:400]}


# --------------------------------------------------------------------------- one configuration


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def _variant_result(step_s: list, flops_per_token: float) -> dict:
    median = statistics.median(step_s)
    tokens_per_s = SEQ * MICRO_BATCH / median
    return {
        "step_ms": round(1000 * median, 2),
        "trial_step_ms": [round(1000 * t, 2) for t in step_s],
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(tokens_per_s * flops_per_token / 1e12, 1),
    }


def _active_kernels(ours: OurLoop) -> dict:
    from megatron.core.fusions.backend import FUSED_OPS, fused_backend
    from megatron.core.ssm.backends import get_ssm_backend
    from megatron.core.transformer.attention import sdpa_backends

    device = ours.trainer.device
    kernels = {op: fused_backend(op, device) for op in FUSED_OPS}
    allowed = sdpa_backends(ours.args.attention_backend, device)
    kernels["attention"] = f"--attention-backend {ours.args.attention_backend}: " + (
        "SDPA's own choice" if allowed is None else ", ".join(backend.name for backend in allowed)
    )
    if ours.args.model_family == "hybrid":
        kernels["ssm_scan"] = get_ssm_backend(device).name
    return kernels


def plain_loop(spec: dict, device) -> PlainLoop:
    """The plain loop of a configuration (its own random weights)."""
    pattern = HYBRID_PATTERN if spec["family"] == "hybrid" else None
    return PlainLoop(PlainLM(spec["plain"], LAYERS, HIDDEN, HEADS, pattern=pattern, mamba=MAMBA), device)


def run_guarded(name: str, opts, budget: Budget, configs_left: int) -> dict:
    """One configuration's result, or its error: side by side (alternating trials), or one loop at
    a time with ``--sequential`` or where the two loops together ran out of device memory."""
    fallback = None
    try:
        if not opts.sequential:
            return run_config(name, opts, budget, configs_left)
    except torch.OutOfMemoryError as error:
        fallback = f"both loops did not fit on the card ({str(error).splitlines()[0]})"
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    finally:
        _cleanup()
    try:  # the failed attempt's frames are gone with its exception: its loops are freed
        result = run_config_sequentially(name, opts)
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    finally:
        _cleanup()
    if fallback:
        result["sequential_because"] = fallback
    return result


def run_config(name: str, opts, budget: Budget, configs_left: int) -> dict:
    share_end = time.perf_counter() + budget.left() / configs_left
    result = {"variants": {}, "errors": {}}
    spec = CONFIGS[name]
    torch.manual_seed(0)
    start = time.perf_counter()
    ours = OurLoop(name)
    flops_per_token = ours.trainer.flops_per_token
    plain = plain_loop(spec, ours.trainer.device)
    result["params"] = {
        "ours": sum(p.numel() for p in ours.trainer.model.parameters()),
        "plain": sum(p.numel() for p in plain.model.parameters()),
    }
    result["flops_per_token"] = flops_per_token
    result["kernels"] = _active_kernels(ours)
    result["build_s"] = round(time.perf_counter() - start, 1)

    steps, trials = (2, 2) if opts.quick else (opts.steps, opts.trials)
    losses = {"ours": [ours.step() for _ in range(opts.warmup)], "plain": [plain.step() for _ in range(opts.warmup)]}
    result["peak_memory_gib"] = {"ours": peak_memory_gib(ours.step), "plain_eager": peak_memory_gib(plain.step)}

    eager = alternating_trials({"ours": ours.step, "plain_eager": plain.step}, trials, steps)
    result["variants"]["plain_eager"] = _variant_result(eager["plain_eager"], flops_per_token)
    result["breakdown_ms"] = {"ours": phase_split_ms(ours.phases()), "plain_eager": phase_split_ms(plain_phases(plain))}
    if not opts.quick:
        result["sdpa_ms"] = sdpa_probe(HEADS, spec["plain"]["groups"], HIDDEN // HEADS)
        with contextlib.suppress(Exception):
            result["step_profile"] = {"ours": step_profile(ours.step), "plain_eager": step_profile(plain.step)}

    ours_times = list(eager["ours"])
    # Each ratio compares the trials of one alternation (the card's clocks drift between them).
    pairs = {("ours", "plain_eager"): (eager["ours"], eager["plain_eager"])}
    try:
        start = time.perf_counter()
        plain.compile()
        losses["plain_compiled"] = [plain.step() for _ in range(opts.warmup)]
        result["compile_s"] = {"plain": round(time.perf_counter() - start, 1)}
        result["peak_memory_gib"]["plain_compiled"] = peak_memory_gib(plain.step)
        compiled = alternating_trials({"ours": ours.step, "plain_compiled": plain.step}, trials, steps)
        ours_times += compiled["ours"]
        pairs["ours", "plain_compiled"] = (compiled["ours"], compiled["plain_compiled"])
        result["variants"]["plain_compiled"] = _variant_result(compiled["plain_compiled"], flops_per_token)
        result["breakdown_ms"]["plain_compiled"] = phase_split_ms(plain_phases(plain))
    except Exception as error:
        result["errors"]["plain_compiled"] = f"{type(error).__name__}: {error}"[:2000]
    result["variants"]["ours"] = _variant_result(ours_times, flops_per_token)

    if opts.quick or opts.skip_ours_compiled or time.perf_counter() > share_end - opts.ours_compile_reserve_s:
        result["errors"]["ours_compiled"] = "skipped (--quick, --skip-ours-compiled or the time budget)"
    else:
        try:
            start = time.perf_counter()
            ours.compile()
            losses["ours_compiled"] = [ours.step() for _ in range(opts.warmup)]
            result.setdefault("compile_s", {})["ours"] = round(time.perf_counter() - start, 1)
            result["peak_memory_gib"]["ours_compiled"] = peak_memory_gib(ours.step)
            rivals = {"ours_compiled": ours.step}
            if "plain_compiled" in result["variants"]:
                rivals["plain_compiled"] = plain.step
            final = alternating_trials(rivals, trials, steps)
            result["variants"]["ours_compiled"] = _variant_result(final["ours_compiled"], flops_per_token)
            if "plain_compiled" in final:
                pairs["ours_compiled", "plain_compiled"] = (final["ours_compiled"], final["plain_compiled"])
            result["breakdown_ms"]["ours_compiled"] = phase_split_ms(ours.phases())
        except Exception as error:
            result["errors"]["ours_compiled"] = f"{type(error).__name__}: {error}"[:2000]
    result["warmup_losses"] = {k: [round(v, 4) for v in vals] for k, vals in losses.items()}
    result["peak_memory_gib"] = {k: round(v, 2) for k, v in result["peak_memory_gib"].items()}

    _add_ratios(result, pairs)
    del ours, plain
    return result


def _add_ratios(result: dict, pairs: dict | None = None) -> None:
    """``ratios[mine/base]``: base's median step time over mine's, from the trials of the
    alternation they ran in together (``pairs[mine, base]``), else (one loop at a time) from
    each variant's median."""
    variants, pairs = result["variants"], pairs or {}
    for base in ("plain_compiled", "plain_eager"):
        for mine in ("ours", "ours_compiled"):
            if (mine, base) in pairs:
                mine_s, base_s = pairs[mine, base]
                ratio = statistics.median(base_s) / statistics.median(mine_s)
            elif mine in variants and base in variants:
                ratio = variants[base]["step_ms"] / variants[mine]["step_ms"]
            else:
                continue
            result.setdefault("ratios", {})[f"{mine}/{base}"] = round(ratio, 3)


def run_config_sequentially(name: str, opts) -> dict:
    """The configuration with one loop on the card at a time (for a card that cannot hold both):
    ours, then the plain loop eager and compiled; no alternation between them, no profiles, no
    ours_compiled."""
    result = {"variants": {}, "errors": {}, "mode": "sequential: one loop on the card at a time"}
    spec = CONFIGS[name]
    steps, trials = (2, 2) if opts.quick else (opts.steps, opts.trials)
    torch.manual_seed(0)
    ours = OurLoop(name)
    flops_per_token, device = ours.trainer.flops_per_token, ours.trainer.device
    result["flops_per_token"] = flops_per_token
    result["kernels"] = _active_kernels(ours)
    result["params"] = {"ours": sum(p.numel() for p in ours.trainer.model.parameters())}
    losses = {"ours": [ours.step() for _ in range(opts.warmup)]}
    peaks = {"ours": peak_memory_gib(ours.step)}
    result["variants"]["ours"] = _variant_result(
        alternating_trials({"ours": ours.step}, trials, steps)["ours"], flops_per_token
    )
    result["breakdown_ms"] = {"ours": phase_split_ms(ours.phases())}
    del ours
    _cleanup()

    plain = plain_loop(spec, device)
    result["params"]["plain"] = sum(p.numel() for p in plain.model.parameters())
    for variant in ("plain_eager", "plain_compiled"):
        try:
            if variant == "plain_compiled":
                plain.compile()
            losses[variant] = [plain.step() for _ in range(opts.warmup)]
            peaks[variant] = peak_memory_gib(plain.step)
            times = alternating_trials({variant: plain.step}, trials, steps)[variant]
            result["variants"][variant] = _variant_result(times, flops_per_token)
            result["breakdown_ms"][variant] = phase_split_ms(plain_phases(plain))
        except Exception as error:
            result["errors"][variant] = f"{type(error).__name__}: {error}"[:2000]
    result["warmup_losses"] = {k: [round(v, 4) for v in vals] for k, vals in losses.items()}
    result["peak_memory_gib"] = {k: round(v, 2) for k, v in peaks.items()}
    _add_ratios(result)
    del plain
    return result


# --------------------------------------------------------------------------- main


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "triton": triton.__version__,
        "sm": f"{props.major}.{props.minor}",
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def _cleanup():
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def must_show(configs: dict) -> dict:
    """The issue's targets, from this run's numbers."""

    def ratio(name, key):
        return configs.get(name, {}).get("ratios", {}).get(key)

    checks = {
        "gpt2 ours/plain_compiled >= 1.07": ratio("gpt2", "ours/plain_compiled"),
        "llama ours/plain_compiled >= 1.0": ratio("llama", "ours/plain_compiled"),
    }
    gpt, hybrid = configs.get("gpt2", {}).get("variants", {}), configs.get("hybrid", {}).get("variants", {})
    if "ours" in gpt and "ours" in hybrid:
        checks["hybrid TFLOP/s / gpt2 TFLOP/s >= 0.7"] = round(hybrid["ours"]["tflops"] / gpt["ours"]["tflops"], 3)
    thresholds = {"gpt2": 1.07, "llama": 1.0, "hybrid": 0.7}
    return {k: {"value": v, "met": None if v is None else v >= thresholds[k.split()[0]]} for k, v in checks.items()}


def _print_config(name: str, result: dict) -> None:
    print(f"== {name}: {result.get('params', {})} params, {result.get('flops_per_token', 0) / 1e9:.2f} GFLOP/token")
    for variant, v in result.get("variants", {}).items():
        print(
            f"   {variant:15s} {v['step_ms']:8.1f} ms/step {v['tokens_per_s']:10.0f} tok/s {v['tflops']:7.1f} TFLOP/s"
        )
    shown = ("mode", "sequential_because", "ratios", "breakdown_ms", "peak_memory_gib", "kernels", "compile_s")
    for key in (*shown, "errors", "error"):
        if result.get(key):
            print(f"   {key}: {result[key]}")
    sys.stdout.flush()


def _write(report: dict, path: str | None) -> None:
    """The JSON so far (written after each stage, so a run cut short still leaves its numbers)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)


def _config_names(text: str) -> list[str]:
    names = list(CONFIGS) if text == "all" else [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {unknown or text!r}; choose all or {', '.join(CONFIGS)}"
        )
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", type=_config_names, default="all", help=f"all, or comma-separated names of {', '.join(CONFIGS)}"
    )
    parser.add_argument("--quick", action="store_true", help="2 trials of 2 steps; no profiles, no ours_compiled")
    parser.add_argument("--steps", type=int, default=2, help="steps per trial")
    parser.add_argument("--trials", type=int, default=3, help="alternating trials per variant")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per variant (compiles)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="time for the whole run")
    parser.add_argument("--ours-compile-reserve-s", type=float, default=40.0)
    parser.add_argument("--skip-ours-compiled", action="store_true")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="one loop on the card at a time (also the fallback where both loops run out of memory)",
    )
    parser.add_argument("--output-json", default=None)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_train: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read at the first allocation
    from megatron.training.initialize import initialize_distributed

    budget = Budget(opts.budget_s)
    initialize_distributed("nccl")  # a world of one; the kernel check's cross-entropy needs a group
    report = {"environment": environment(), "options": vars(opts), "configs": {}}
    report["kernel_check"] = check_kernels(torch.device("cuda"))
    print(f"environment: {report['environment']}\nkernel check: {report['kernel_check']}", flush=True)
    _write(report, opts.output_json)
    names = opts.config
    for index, name in enumerate(names):
        report["configs"][name] = run_guarded(name, opts, budget, len(names) - index)
        _print_config(name, report["configs"][name])
        report["must_show"] = must_show(report["configs"])
        report["total_s"] = round(opts.budget_s - budget.left(), 1)
        _write(report, opts.output_json)
    print(f"must show: {json.dumps(report['must_show'])}\ntotal {report['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
