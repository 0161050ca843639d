"""Vocab-parallel cross-entropy against torch.nn.functional.cross_entropy (loss and grad)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import TensorParallelError, vocab_parallel_cross_entropy
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.tensor_parallel import helpers  # noqa: F401  (pre-imports what forked ranks need)

S, B, V = 5, 3, 16


def _check_cross_entropy():
    world, me = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(S, B, V, generator=g) * 4
    target = torch.randint(0, V, (S, B), generator=g)
    target[0, 0], target[-1, -1] = 0, V - 1  # the first and last id of the vocabulary
    dloss = torch.rand(S, B, generator=g)

    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.reshape(-1, V), target.reshape(-1), reduction="none").reshape(S, B)
    (ref * dloss).sum().backward()

    local = logits.chunk(world, dim=-1)[me].to(device()).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target.to(device()), dist.group.WORLD)
    torch.testing.assert_close(loss.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
    (loss * dloss.to(device())).sum().backward()
    torch.testing.assert_close(local.grad.cpu(), full.grad.chunk(world, dim=-1)[me], rtol=1e-5, atol=1e-6)

    with pytest.raises(
        TensorParallelError, match=r"logits shape \(5, 3, \d+\) must be target shape \(5, 2\) plus a vocabulary dim"
    ):
        vocab_parallel_cross_entropy(local, target[:, :2].to(device()), dist.group.WORLD)
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(world):
    assert run_distributed(_check_cross_entropy, world) == [True] * world
