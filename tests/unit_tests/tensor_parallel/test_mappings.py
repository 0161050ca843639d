"""Each autograd collective's forward and backward against a single-process computation on the
concatenation of every rank's inputs."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.collectives import all_gather_along_dim, reduce_scatter_along_dim0
from megatron.core.tensor_parallel.utils import TensorParallelError
from tests.unit_tests.dist_harness import device, run_distributed

SHAPE = (4, 2, 8)  # [s, b, h]; s and h divisible by 1, 2 and 4 ranks


def rank_data(rank, shape=SHAPE):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def reference(name, world, me):
    """Expected (forward output, input grad) on rank ``me`` when every rank r feeds x_r and
    backpropagates dy_r through ``name`` (shapes of dy follow the output)."""
    xs = [rank_data(r)[0] for r in range(world)]

    def chunk(t, dim, i):
        return t.chunk(world, dim=dim)[i]

    dys = [rank_data(r, out_shape(name, world))[1] for r in range(world)]
    if name == "copy":
        return xs[me], sum(dys)
    if name == "reduce":
        return sum(xs), dys[me]
    if name == "scatter_tp":
        return chunk(xs[me], -1, me), torch.cat(dys, dim=-1)
    if name == "gather_tp":
        return torch.cat(xs, dim=-1), chunk(dys[me], -1, me)
    if name == "scatter_sp":
        return chunk(xs[me], 0, me), torch.cat(dys, dim=0)
    if name == "gather_sp":
        return torch.cat(xs, dim=0), chunk(sum(dys), 0, me)
    if name == "gather_sp_no_reduce":
        return torch.cat(xs, dim=0), chunk(dys[me], 0, me)
    if name == "reduce_scatter_sp":
        return chunk(sum(xs), 0, me), torch.cat(dys, dim=0)
    raise AssertionError(name)


def out_shape(name, world):
    s, b, h = SHAPE
    return {
        "scatter_tp": (s, b, h // world),
        "gather_tp": (s, b, h * world),
        "scatter_sp": (s // world, b, h),
        "gather_sp": (s * world, b, h),
        "gather_sp_no_reduce": (s * world, b, h),
        "reduce_scatter_sp": (s // world, b, h),
    }.get(name, SHAPE)


FUNCTIONS = {
    "copy": mappings.copy_to_tensor_model_parallel_region,
    "reduce": mappings.reduce_from_tensor_model_parallel_region,
    "scatter_tp": mappings.scatter_to_tensor_model_parallel_region,
    "gather_tp": mappings.gather_from_tensor_model_parallel_region,
    "scatter_sp": mappings.scatter_to_sequence_parallel_region,
    "gather_sp": mappings.gather_from_sequence_parallel_region,
    "gather_sp_no_reduce": lambda x, g: mappings.gather_from_sequence_parallel_region(
        x, g, tensor_parallel_output_grad=False
    ),
    "reduce_scatter_sp": mappings.reduce_scatter_to_sequence_parallel_region,
}


def _check_all_mappings():
    world, me = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    for name, fn in FUNCTIONS.items():
        x = rank_data(me)[0].to(device()).requires_grad_(True)
        y = fn(x, group)
        expected_y, expected_dx = reference(name, world, me)
        torch.testing.assert_close(y.detach().cpu(), expected_y, rtol=1e-6, atol=1e-6, msg=f"{name} forward")
        y.backward(rank_data(me, out_shape(name, world))[1].to(device()))
        torch.testing.assert_close(x.grad.cpu(), expected_dx, rtol=1e-6, atol=1e-6, msg=f"{name} backward")
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mappings_forward_and_backward_match_single_process(world):
    assert run_distributed(_check_all_mappings, world) == [True] * world


def _check_collective_helpers():
    """all-gather on a non-leading dim and reduce-scatter (gloo: the all-reduce + slice fallback)."""
    me = dist.get_rank()
    x = (torch.arange(6.0).reshape(2, 3) + 10 * me).to(device())
    gathered = all_gather_along_dim(x, 1, dist.group.WORLD).cpu()
    torch.testing.assert_close(gathered, torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(2)], dim=1))
    total = reduce_scatter_along_dim0(x, dist.group.WORLD).cpu()
    torch.testing.assert_close(total, (2 * torch.arange(6.0).reshape(2, 3) + 10)[me : me + 1])
    with pytest.raises(
        TensorParallelError, match=r"reduce-scatter needs dim 0 \(3\) divisible by the group size \(2\)"
    ):
        reduce_scatter_along_dim0(torch.zeros(3, 1), dist.group.WORLD)
    with pytest.raises(
        TensorParallelError,
        match=r"cannot split dimension 2 \(size 3\) of a tensor of shape \(1, 1, 3\) into 2 equal parts",
    ):
        mappings.scatter_to_tensor_model_parallel_region(torch.zeros(1, 1, 3), dist.group.WORLD)
    return True


def test_dim_collectives_and_indivisible_sizes():
    assert run_distributed(_check_collective_helpers, 2) == [True, True]
