"""The fused output layer + cross-entropy against torch's cross-entropy of ``hidden @ W^T`` over
the whole (unpadded) vocabulary, reduced the way training reduces it (the loss-mask-weighted
mean times a scale): losses and the gradients of hidden and W, fp32 and bf16 operands, fp32
logits of bf16 operands, several token chunks, vocabulary padding, on the Triton kernels and
the torch ops. The model path (GPT with a loss mask) gives the unfused path's loss and
gradients. The two-rank case is test_linear_cross_entropy_tp2.py (its own GPU bucket)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.fusions import fusion_backend
from megatron.core.fusions.linear_cross_entropy import chunk_rows, linear_cross_entropy
from megatron.core.tensor_parallel import TensorParallelError
from tests.unit_tests.dist_harness import device, run_distributed

S, B, H = 5, 2, 16
VOCAB, PADDED = 37, 40  # ids 37..39 are padding: never in the softmax, zero gradient rows
SCALE = 2.5  # the loss scale / micro-batch factor the gradient reaching the loss carries


def _inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, B, H, generator=gen)
    weight = 0.5 * torch.randn(PADDED, H, generator=gen)
    target = torch.randint(0, VOCAB, (S, B), generator=gen)
    target[0, 0], target[-1, -1] = 0, VOCAB - 1
    mask = (torch.rand(S, B, generator=gen) > 0.3).float()
    mask[0, 0] = 1.0
    return hidden, weight, target, mask


def _reduce(loss, mask):
    """What training's loss_func does with the loss mask, times the loss scale."""
    return SCALE * (loss * mask).sum() / mask.sum()


def _reference(dtype):
    hidden, weight, target, mask = _inputs()
    hidden = hidden.to(dtype).float().requires_grad_()
    weight = weight.to(dtype).float().requires_grad_()
    logits = hidden.reshape(-1, H) @ weight[:VOCAB].t()
    loss = F.cross_entropy(logits, target.reshape(-1), reduction="none").view(S, B)
    _reduce(loss, mask).backward()
    return loss.detach(), hidden.grad, weight.grad


def _check(dtype, logit_dtype, backend):
    world, me = dist.get_world_size(), dist.get_rank()
    ref_loss, ref_dhidden, ref_dweight = _reference(dtype)
    hidden, weight, target, mask = _inputs()
    dev = device()
    hidden = hidden.to(dtype).to(dev).requires_grad_()
    local_weight = weight.to(dtype).chunk(world)[me].clone().to(dev).requires_grad_()
    local_vocab = local_weight.shape[0]
    with fusion_backend(backend):
        loss = linear_cross_entropy(
            hidden,
            local_weight,
            target.to(dev),
            dist.group.WORLD,
            vocab_size=VOCAB,
            token_weight=mask.to(dev),
            logit_dtype=logit_dtype,
            chunk_logit_elements=3 * local_vocab,  # 3 tokens a chunk: 4 chunks, the last short
        )
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    _reduce(loss, mask.to(dev)).backward()
    dhidden = hidden.grad.float()
    dist.all_reduce(dhidden)  # each rank's vocabulary slice contributes (the TP region's backward)
    exact = dtype == torch.float32 or logit_dtype == torch.float32
    loss_tolerance = dict(rtol=1e-5, atol=1e-5) if exact else dict(rtol=2e-2, atol=2e-2)
    grad_tolerance = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss.detach().cpu(), ref_loss, **loss_tolerance)
    assert hidden.grad.dtype == local_weight.grad.dtype == dtype
    torch.testing.assert_close(dhidden.cpu(), ref_dhidden, **grad_tolerance)
    torch.testing.assert_close(local_weight.grad.float().cpu(), ref_dweight.chunk(world)[me], **grad_tolerance)
    return True


def check_linear_cross_entropy(dtype, logit_dtype, backend):
    """Run on every rank of a TP group of any size; True when every check passed."""
    return _check(dtype, logit_dtype, backend)


# fp32 operands on the kernels are test_cross_entropy.py's (the interpreter is slow).
CASES = [
    (torch.float32, None, "torch"),
    (torch.bfloat16, None, "torch"),
    (torch.bfloat16, torch.float32, "torch"),
    (torch.bfloat16, None, "triton"),
    (torch.bfloat16, torch.float32, "triton"),
]
IDS = ["fp32-torch", "bf16-torch", "bf16-fp32logits-torch", "bf16-triton", "bf16-fp32logits-triton"]


@pytest.mark.parametrize(("dtype", "logit_dtype", "backend"), CASES, ids=IDS)
def test_linear_cross_entropy_matches_torch_on_one_rank(dtype, logit_dtype, backend):
    assert run_distributed(_check, 1, dtype, logit_dtype, backend) == [True]


def test_chunks_are_whole_gemm_tiles_and_cover_small_inputs():
    assert chunk_rows(16384, 50304) == 5248  # 2**28 logits, rounded down to 128 rows
    assert chunk_rows(10, 20, chunk_logit_elements=60) == 3
    assert chunk_rows(10, 20, chunk_logit_elements=1) == 1
    assert chunk_rows(10, 20) == 10


def test_bad_token_weight_shape_is_refused():
    hidden, weight, target, mask = _inputs()
    with pytest.raises(TensorParallelError, match=r"token_weight shape \(2, 5\) must be the target shape \(5, 2\)"):
        linear_cross_entropy(hidden, weight, target, None, token_weight=mask.t())
