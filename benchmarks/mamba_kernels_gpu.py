"""GPU check (not a test): the same bf16 MambaMixer on CUDA with mamba-ssm's Triton kernels and
with our torch reference scan. Prints the max differences of outputs, input gradients and
decode outputs, and the step times of both backends.

    python -m benchmarks.mamba_kernels_gpu [--batch 2 --seq 2048 --hidden 1024 ...]   (from the repo root)

Exits with status 2 (and says why) where CUDA or the mamba-ssm kernels are missing. Safe to
import anywhere: nothing runs at import time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks.cuda_timing import cuda_timed


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--iters", type=int, default=10)
    return p.parse_args(argv)


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


def _decode(mixer, x, prefix, steps):
    """Prefill ``prefix`` tokens, then decode ``steps`` tokens one by one; outputs [steps, b, h]."""
    ctx = _States(mixer.dims, x.shape[1], x.device)
    with torch.no_grad():
        mixer(x[:prefix], inference_context=ctx)
        ctx.decode = True
        return torch.cat([mixer(x[t : t + 1], inference_context=ctx)[0] for t in range(prefix, prefix + steps)])


def run(args) -> int:
    from megatron.core.config import TransformerConfig
    from megatron.core.process_groups import ProcessGroupCollection, RankLayout
    from megatron.core.ssm.backends import load_mamba_kernels
    from megatron.core.ssm.mamba_mixer import MambaMixer

    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to compare (run this on a GPU machine)")
        return 2
    if load_mamba_kernels() is None:
        print("mamba_ssm Triton kernels did not import (pip install mamba-ssm): nothing to compare")
        return 2
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=8,
        bf16=True,
        add_bias_linear=False,
        mamba_num_heads=args.heads,
        mamba_head_dim=args.head_dim,
        mamba_num_groups=args.groups,
        mamba_state_dim=args.state,
        mamba_chunk_size=args.chunk,
    )
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            mixer = MambaMixer(config, layer_number=1, pg_collection=ProcessGroupCollection.from_layout(RankLayout()))
            mixer = mixer.cuda()
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
            dout = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g)
            results = {}
            for backend in ("torch", "triton"):
                mixer.ssm_backend = backend
                xin = x.clone().requires_grad_(True)
                out, _ = mixer(xin)
                out.backward(dout)
                fwd = cuda_timed(lambda: mixer(x), args.iters)

                def fwd_bwd():
                    out, _ = mixer(x.clone().requires_grad_(True))
                    out.backward(dout)

                step = cuda_timed(fwd_bwd, args.iters)
                decode_out = _decode(mixer, x, args.seq - args.decode_steps, args.decode_steps)
                decode_time = cuda_timed(lambda: _decode(mixer, x, 1, 1), args.iters)
                results[backend] = dict(
                    out=out.detach().float(),
                    grad=xin.grad.float(),
                    decode=decode_out.float(),
                    fwd=fwd,
                    step=step,
                    decode_time=decode_time,
                )
                mixer.zero_grad(set_to_none=True)
        finally:
            dist.destroy_process_group()
    ref, fast = results["torch"], results["triton"]
    print(
        f"mixer: hidden {args.hidden}, heads {args.heads}x{args.head_dim}, groups {args.groups}, "
        f"state {args.state}, chunk {args.chunk}; batch {args.batch}, seq {args.seq}; bf16"
    )
    for key in ("out", "grad", "decode"):
        diff = (fast[key] - ref[key]).abs().max().item()
        scale = ref[key].abs().max().item()
        print(f"  {key:6s}: max |triton - torch| = {diff:.3e}  (max |torch| = {scale:.3e}, rel {diff / scale:.3e})")
    for key, label in (("fwd", "forward"), ("step", "forward+backward"), ("decode_time", "prefill 1 + decode 1")):
        print(
            f"  {label:22s}: torch {ref[key] * 1e3:8.2f} ms   triton {fast[key] * 1e3:8.2f} ms   "
            f"speed-up {ref[key] / fast[key]:.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run(_parse_args(sys.argv[1:])))
