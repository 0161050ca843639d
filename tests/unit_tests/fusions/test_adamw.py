"""FlatAdamW (one Triton kernel per flat buffer) against torch's AdamW: the same masters, moments
and step counts for two param groups with their own lr and weight decay, an lr changed between
steps, a clipping factor (``grad_scale``) and a skipped step (``found_inf``); the low-precision
parameters written in the same pass; loaded state copied into its flat storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.optimizer.flat_adamw import FlatAdamW, FlatAdamWError, flat_launch_count
from tests.unit_tests.fusions.kernels import DEVICE

BETAS, EPS = (0.8, 0.95), 1e-6
# Odd sizes put pieces at offsets that are no multiple of 8 (the kernel's unaligned variant); the
# longest sizes span several 4096-element tiles; "mixed" ends with an odd piece after aligned ones.
SIZES = {
    "unaligned": [(3, 7), (5,), (64,), (130,), (9000,)],
    "aligned": [(8, 8), (16,), (8200,)],
    "mixed": [(16,), (8200,), (3,)],
}
TILE_CLASSES = {"unaligned": [False], "aligned": [True], "mixed": [False, True]}


class FlatModel:
    """Parameters (``dtype``) and fp32 gradients as views of one flat buffer each, like DDP's."""

    def __init__(self, shapes, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        numels = [torch.Size(shape).numel() for shape in shapes]
        self.param_data = torch.randn(sum(numels), generator=gen).to(DEVICE, dtype)
        self.grad_data = torch.zeros(sum(numels), device=DEVICE)
        self.params, self.grads, start = [], [], 0
        for shape, numel in zip(shapes, numels, strict=True):
            self.params.append(self.param_data[start : start + numel].view(shape))
            self.grads.append(self.grad_data[start : start + numel].view(shape))
            start += numel

    def masters(self):
        """fp32 masters: copies of low-precision parameters, else the parameters themselves."""
        return [p.float().clone() if p.dtype != torch.float32 else p for p in self.params]

    def fill_grads(self, step):
        gen = torch.Generator().manual_seed(1000 + step)
        self.grad_data.copy_(torch.randn(self.grad_data.numel(), generator=gen))


def _groups(masters):
    """Two groups: the first masters decayed at lr 1e-2, the rest undecayed at lr 3e-3."""
    return [
        {"params": masters[:2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": masters[2:], "lr": 3e-3, "weight_decay": 0.0},
    ]


def _flat_optimizer(model):
    masters = model.masters()
    optimizer = FlatAdamW(
        _groups(masters), list(zip(model.grads, model.params, strict=True)), lr=1.0, betas=BETAS, eps=EPS
    )
    return optimizer, masters


def _assert_rounded_copy(param, master):
    """``param`` is ``master`` rounded to its dtype: exactly on CUDA; on CPU within one ulp (Triton's
    interpreter narrows fp32 to bf16 by truncation)."""
    if param.dtype == master.dtype or DEVICE.type == "cuda":
        assert torch.equal(param, master.to(param.dtype))
        return
    ulp = torch.finfo(param.dtype).eps * master.abs()
    assert torch.all((param.float() - master).abs() <= ulp)


def _step(optimizer, masters, grads, grad_scale=None, found_inf=None):
    for master, grad in zip(masters, grads, strict=True):
        master.grad = grad
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    optimizer.step()
    optimizer.grad_scale = optimizer.found_inf = None


@pytest.mark.parametrize("layout", sorted(SIZES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flat_adamw_steps_like_torch_adamw(layout, dtype):
    model = FlatModel(SIZES[layout], dtype)
    optimizer, masters = _flat_optimizer(model)
    assert [sorted(launch.tiles) for launch in optimizer._launches] == [TILE_CLASSES[layout]]
    ref_masters = [m.detach().clone() for m in masters]
    reference = torch.optim.AdamW(_groups(ref_masters), lr=1.0, betas=BETAS, eps=EPS, foreach=False)
    scale = torch.tensor([4.0], device=DEVICE)
    skip, go = torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE)
    plan = [(None, None), (scale, go), (None, skip), (scale, None)]  # step 3 is skipped
    for step, (grad_scale, found_inf) in enumerate(plan):
        model.fill_grads(step)
        if step == 1:  # what an lr scheduler does between steps
            for group in optimizer.param_groups + reference.param_groups:
                group["lr"] *= 0.5
        _step(optimizer, masters, model.grads, grad_scale, found_inf)
        if found_inf is skip:
            continue
        for ref_master, grad in zip(ref_masters, model.grads, strict=True):
            ref_master.grad = grad / (1.0 if grad_scale is None else grad_scale)
        reference.step()
    for master, ref_master, param in zip(masters, ref_masters, model.params, strict=True):
        torch.testing.assert_close(master, ref_master, rtol=2e-6, atol=1e-7)
        _assert_rounded_copy(param, master)
        state, ref_state = optimizer.state[master], reference.state[ref_master]
        assert float(state["step"]) == float(ref_state["step"]) == 3.0
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-8)


def test_loaded_state_lands_in_the_flat_storage_and_continues_the_run():
    """``load_state_dict`` copies into the flat storage at once; state written into ``state``
    directly (how a checkpoint load installs it) is copied in at the next step."""
    model, twin = FlatModel(SIZES["unaligned"], torch.bfloat16), FlatModel(SIZES["unaligned"], torch.bfloat16)
    optimizer, masters = _flat_optimizer(model)
    for step in range(2):
        model.fill_grads(step)
        _step(optimizer, masters, model.grads)
    twin_optimizer, twin_masters = _flat_optimizer(twin)
    for mine, theirs in zip(masters, twin_masters, strict=True):
        theirs.copy_(mine)
    owned = [twin_optimizer.state[m]["exp_avg"] for m in twin_masters]
    twin_optimizer.load_state_dict(optimizer.state_dict())
    assert all(twin_optimizer.state[m]["exp_avg"] is t for m, t in zip(twin_masters, owned, strict=True))
    assert torch.equal(owned[0], optimizer.state[masters[0]]["exp_avg"])
    last = twin_masters[-1]
    mine = optimizer.state[masters[-1]]
    twin_optimizer.state[last] = {"step": torch.tensor(2.0), **{k: mine[k].clone() for k in ("exp_avg", "exp_avg_sq")}}
    twin_optimizer.state[last]["exp_avg"].zero_()  # differs from what the flat storage holds
    mine["exp_avg"].zero_()
    for flat in (model, twin):
        flat.fill_grads(2)
    _step(optimizer, masters, model.grads)
    _step(twin_optimizer, twin_masters, twin.grads)
    assert all(twin_optimizer.state[m]["exp_avg"] is t for m, t in zip(twin_masters, owned, strict=True))
    for mine, theirs in zip(masters + model.params, twin_masters + twin.params, strict=True):
        assert torch.equal(mine, theirs)
    assert float(twin_optimizer.state[last]["step"]) == 3.0


def test_a_gradient_that_is_not_the_flat_view_is_refused():
    model = FlatModel(SIZES["aligned"], torch.bfloat16)
    optimizer, masters = _flat_optimizer(model)
    model.fill_grads(0)
    grads = [g.clone() for g in model.grads]
    with pytest.raises(FlatAdamWError, match=r"gradient of a master of shape \(8, 8\) is not the flat-buffer view"):
        _step(optimizer, masters, grads)


def test_param_groups_are_fixed_at_construction():
    optimizer, _ = _flat_optimizer(FlatModel(SIZES["aligned"], torch.bfloat16))
    with pytest.raises(FlatAdamWError, match="lays out its masters once, at construction"):
        optimizer.add_param_group({"params": [torch.zeros(4, device=DEVICE)]})


def test_launch_count_groups_masters_by_storage_and_refuses_what_it_cannot_step():
    model, other = FlatModel(SIZES["aligned"], torch.bfloat16), FlatModel([(4,)], torch.bfloat16)
    masters, sources = model.masters(), list(zip(model.grads, model.params, strict=True))
    assert flat_launch_count(sources, masters) == 1
    assert flat_launch_count(sources + [(other.grads[0], other.params[0])], masters + other.masters()) == 2
    bf16_grad = [(model.grads[0].bfloat16(), model.params[0])]
    assert flat_launch_count(bf16_grad, masters[:1]) is None  # gradients must be fp32


# Compiles the kernel for an H100/H200 (sm_90, no GPU needed) and prints its PTX for both
# alignments as JSON. It runs in a fresh process without TRITON_INTERPRET: once the interpreter
# has called a nested @triton.jit function (other fusions' tests do), Triton 3.9 leaves
# triton.language patched for the rest of the process, and a real compile there fails.
_PTX_SCRIPT = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron.core.fusions import adamw_triton

kernel = adamw_triton._adamw_kernel
pointers = ["*i64", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32"]
names = list(kernel.arg_names)
ptx = {}
for aligned in (True, False):
    flags = dict(HAS_COPY=True, HAS_SCALE=True, HAS_FOUND_INF=True, ALIGNED=aligned, BLOCK=adamw_triton.BLOCK)
    source = ASTSource(
        fn=kernel,
        signature={**dict(zip(names, pointers, strict=False)), **dict.fromkeys(flags, "constexpr")},
        constexprs=flags,
        attrs={(i,): [["tt.divisibility", 16]] for i in range(len(pointers))},  # what Triton sees at launch
    )
    options = {"num_warps": adamw_triton.WARPS, "enable_fp_fusion": True}
    ptx[str(aligned)] = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
print(json.dumps(ptx))
"""


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    done = subprocess.run(
        [sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("aligned", [True, False])
def test_the_aligned_kernel_moves_16_byte_vectors(aligned, sm90_ptx):
    """Compiled for an H100/H200 (sm_90): with every offset and size a multiple of 8 the kernel
    loads and stores the fp32 tensors in 16-byte vectors; without, in 4-byte words."""
    from megatron.core.fusions import adamw_triton

    ptx = sm90_ptx[str(aligned)]
    per_thread = adamw_triton.BLOCK // (32 * adamw_triton.WARPS)
    vector_loads, vector_stores = ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32")
    if aligned:  # grad, master, exp_avg, exp_avg_sq in; master, moments and the bf16 copy out
        assert (vector_loads, vector_stores) == (4 * per_thread // 4, 3 * per_thread // 4 + per_thread // 8)
    else:
        assert vector_loads == vector_stores == 0
