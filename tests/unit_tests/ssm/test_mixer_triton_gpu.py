"""On CUDA, the Mamba mixer's fused Triton sequence path (our conv and gated-norm kernels around
mamba-ssm's scan passes, one autograd Function) against the torch reference path: outputs and
the gradients of the input and of every parameter in bf16, and the Triton prefill + decode
paths continuing the fused whole-sequence output. The oracle is the torch path in fp32 on the
same (bf16-valued) weights; the fast path must be within 1e-2 of it, or at worst twice as far
as the bf16 torch path is (bf16 rounding of small reductions such as ``A_log``'s gradient)."""

import dataclasses

import pytest
import torch

from megatron.core.ssm.backends import TritonSSMBackend, get_ssm_backend
from megatron.core.ssm.mamba_mixer import MambaMixer
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.ssm.test_mamba_mixer import StateContext, mamba_config, single_rank_collection

pytestmark = pytest.mark.gpu(1)

HIDDEN, SEQ, BATCH = 512, 300, 2  # 300 tokens: two full 128-token chunks and a ragged one


def _mixers():
    config = mamba_config(
        hidden_size=HIDDEN,
        mamba_num_heads=16,
        mamba_head_dim=64,
        mamba_num_groups=2,
        mamba_state_dim=128,
        bf16=True,
    )
    torch.manual_seed(0)
    fast = MambaMixer(config, layer_number=1, pg_collection=single_rank_collection(), ssm_backend="triton").cuda()
    with torch.no_grad():  # make every parameter non-trivial
        for p in fast.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fp32 = dataclasses.replace(config, bf16=False, params_dtype=torch.float32)
    oracle = MambaMixer(fp32, layer_number=1, pg_collection=fast.pg_collection, ssm_backend="torch").cuda()
    oracle.load_state_dict(fast.state_dict())
    return fast, oracle


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _fused_path_errors():
    assert isinstance(get_ssm_backend(torch.device("cuda")), TritonSSMBackend)
    fast, oracle = _mixers()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g)
    grad_out = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g)
    results = {}
    for name, mixer, backend, dtype in (
        ("fast", fast, "triton", torch.bfloat16),
        ("reference", fast, "torch", torch.bfloat16),
        ("oracle", oracle, "torch", torch.float32),
    ):
        mixer.ssm_backend = backend
        mixer.zero_grad(set_to_none=True)
        xin = x.to(dtype).requires_grad_(True)
        out, _ = mixer(xin)
        out.backward(grad_out.to(dtype))
        assert out.dtype == dtype
        results[name] = {"out": out.detach(), "input grad": xin.grad} | {n: p.grad for n, p in mixer.named_parameters()}
    return {
        key: (rel_err(results["fast"][key], want), rel_err(results["reference"][key], want))
        for key, want in results["oracle"].items()
    }


def test_fused_path_matches_reference_forward_and_backward_in_bf16():
    (errors,) = run_distributed(_fused_path_errors, 1)
    assert len(errors) == 10  # out, input grad and the 8 parameters
    bad = {key: (fast, ref) for key, (fast, ref) in errors.items() if not fast < max(1e-2, 2 * ref)}
    assert not bad, f"(fast, bf16 reference) relative errors vs fp32 beyond tolerance: {bad}"


def _prefill_and_decode_errors():
    fast, _ = _mixers()
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        full, _ = fast(x)
        ctx = StateContext(fast.dims, batch=BATCH)
        ctx.conv_state, ctx.ssm_state = ctx.conv_state.cuda(), ctx.ssm_state.cuda()
        first, _ = fast(x[:200], inference_context=ctx)
        second, _ = fast(x[200:296], inference_context=ctx)
        ctx.decode = True
        steps = [fast(x[t : t + 1], inference_context=ctx)[0] for t in range(296, SEQ)]
    return rel_err(torch.cat([first, second, *steps]), full)


def test_triton_prefill_and_decode_continue_the_fused_whole_sequence_output():
    (err,) = run_distributed(_prefill_and_decode_errors, 1)
    assert err < 1e-2
