"""The Triton vocab-parallel cross-entropy against torch's cross-entropy over the whole
vocabulary on one rank (several vocabulary tiles): bf16 logits (fp32 math, no fp32 copy of
the logits: their storage becomes their gradient), forward-only calls, bad shapes. The
two-rank case is test_cross_entropy_tp2.py (its own GPU bucket)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.fusions import fusion_backend, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel import TensorParallelError
from tests.unit_tests.dist_harness import device, run_distributed

S, B, V = 5, 3, 4100  # more than one 4096-wide vocabulary tile per rank at world 1


def _check(dtype):
    world, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(S, B, V, generator=gen)).to(dtype)
    target = torch.randint(0, V, (S, B), generator=gen)
    target[0, 0], target[-1, -1] = 0, V - 1
    dloss = torch.rand(S, B, generator=gen)
    full = logits.float().clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, V), target.reshape(-1), reduction="none").reshape(S, B)
    (ref * dloss).sum().backward()

    local = logits.chunk(world, dim=-1)[me].clone().to(device()).requires_grad_()
    seen = {}
    with fusion_backend("triton"):
        scaled = local * 1  # an intermediate like the output layer's logits
        scaled.register_hook(lambda grad: seen.update(same_storage=grad.data_ptr() == scaled.data_ptr()))
        loss = vocab_parallel_cross_entropy(scaled, target.to(device()), dist.group.WORLD)
        with torch.no_grad():
            bare = vocab_parallel_cross_entropy(local, target.to(device()), dist.group.WORLD)
    assert loss.dtype == torch.float32 and bare.grad_fn is None
    torch.testing.assert_close(loss.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bare.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    (loss * dloss.to(device())).sum().backward()
    assert seen["same_storage"]
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=4e-3)
    assert local.grad.dtype == dtype
    torch.testing.assert_close(local.grad.float().cpu(), full.grad.chunk(world, dim=-1)[me], **tolerance)

    with fusion_backend("triton"), pytest.raises(TensorParallelError, match=r"must be target shape \(5, 2\) plus"):
        vocab_parallel_cross_entropy(local, target[:, :2].to(device()), dist.group.WORLD)
    return True


def check_cross_entropy(dtype):
    """Run on every rank of a TP group of any size; True when every check passed."""
    return _check(dtype)


def test_triton_cross_entropy_matches_torch_on_one_rank():
    assert run_distributed(_check, 1, torch.bfloat16) == [True]
