"""DistributedDataParallel: buffered gradients equal single-process gradients of the whole batch."""

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core.config import ModelParallelConfig
from megatron.core.distributed import (
    DistributedConfigError,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    GradSyncOrderError,
)
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import device, run_distributed


def tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device())


def batch(num_rows):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(num_rows, 4, generator=gen).to(device()), torch.randn(num_rows, 3, generator=gen).to(device())


def mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def reference_grads(model, x, y):
    """Single-process gradients of the mean loss on the whole batch."""
    ref = copy.deepcopy(model)
    mse(ref, x, y).backward()
    return {name: p.grad for name, p in ref.named_parameters()}


def _dp2_grads_match(ddp_kwargs):
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(2))
    model = tiny_mlp()
    x, y = batch(8)
    expected = reference_grads(model, x, y)
    ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model, pg_collection=pgc)
    rank = pgc.rank("dp_cp")
    rows = slice(4 * rank, 4 * rank + 4)
    for _ in range(2):  # the second iteration proves zero_grad_buffer re-arms the buckets
        ddp.zero_grad_buffer()
        mse(ddp, x[rows], y[rows]).backward()
        ddp.finish_grad_sync()
        for name, param in model.named_parameters():
            assert param.grad is None
            if ddp_config.use_distributed_optimizer:
                _check_owned_shard(ddp, param, expected[name])
            else:
                torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-5, atol=1e-6)
    return len(ddp.param_and_grad_buffers[0].buckets)


def _check_owned_shard(ddp, param, expected):
    """With the distributed optimizer only the replica's own shard of each bucket is promised."""
    (buffer,) = ddp.param_and_grad_buffers
    start, end = buffer.param_range(param)
    lo, hi = buffer.bucket_of(param).shard_range()
    lo, hi = max(lo, start), min(hi, end)
    if lo < hi:
        torch.testing.assert_close(
            buffer.grad_data[lo:hi], expected.reshape(-1)[lo - start : hi - start], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "ddp_kwargs, num_buckets",
    [
        (dict(), 1),
        (dict(overlap_grad_reduce=True, bucket_size=30), 2),
        (dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=8), 3),
    ],
    ids=["one-bucket", "overlap-buckets", "distributed-optimizer"],
)
def test_dp2_grads_equal_single_process_grads_of_concatenated_batch(ddp_kwargs, num_buckets):
    assert run_distributed(_dp2_grads_match, 2, ddp_kwargs) == [num_buckets, num_buckets]


class _GtpGather(torch.autograd.Function):
    """Hand-written GTP weight re-materialization: all-gather dim 0 forward; reduce-scatter
    the weight gradient x 1/G backward (what the GTP layers do for mean losses)."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, shard.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size = dist.get_world_size(ctx.group)
        rows = grad.shape[0] // size
        return grad[dist.get_rank(ctx.group) * rows :][:rows] / size, None


class GtpToyModel(torch.nn.Module):
    """``tanh(x W^T + b) . head`` with W sharded on dim 0 over ``group`` (whole when None) and
    b, head replicated."""

    def __init__(self, full_weight, bias, head, group):
        super().__init__()
        size, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
        rows = full_weight.shape[0] // size
        self.weight = torch.nn.Parameter(full_weight[rank * rows : (rank + 1) * rows].clone())
        self.weight.gtp_sharded, self.weight.gtp_rows = True, full_weight.shape[0]
        self.bias = torch.nn.Parameter(bias.clone())
        self.head = torch.nn.Parameter(head.clone())
        for replicated in (self.bias, self.head):
            replicated.gtp_sharded = False
        self.group = group

    def forward(self, x):
        weight = _GtpGather.apply(self.weight, self.group) if self.group is not None else self.weight
        return (torch.tanh(x @ weight.t() + self.bias) * self.head).sum(-1)


def _dp2_gtp2_grads_match():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(4, gtp=2))
    gen = torch.Generator().manual_seed(3)
    weight, bias, head = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen)

    full = GtpToyModel(weight, bias, head, None)
    torch.nn.functional.mse_loss(full(x), y).backward()

    model = GtpToyModel(weight, bias, head, pgc.gtp)
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(), model, pg_collection=pgc)
    shard = pgc.rank("dp_cp_gtp")  # GTP peers read different micro-batches
    rows = slice(2 * shard, 2 * shard + 2)
    torch.nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
    for replicated in (model.bias, model.head):  # finalize_model_grads' job: mean over gtp
        dist.all_reduce(replicated.main_grad, group=pgc.gtp)
        replicated.main_grad /= pgc.size("gtp")
    ddp.finish_grad_sync()

    gtp_rank = pgc.rank("gtp")
    torch.testing.assert_close(
        model.weight.main_grad, full.weight.grad[3 * gtp_rank : 3 * gtp_rank + 3], rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(model.bias.main_grad, full.bias.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.main_grad, full.head.grad, rtol=1e-5, atol=1e-6)
    return pgc.size("dp_cp")


def test_dp2_gtp2_grads_are_the_mean_over_all_four_data_shards():
    assert run_distributed(_dp2_gtp2_grads_match, 4) == [2, 2, 2, 2]


def _no_sync_accumulates():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(2))
    model = tiny_mlp()
    x, y = batch(8)
    expected = reference_grads(model, x, y)
    rank = pgc.rank("dp_cp")
    micro = [slice(4 * rank + 2 * m, 4 * rank + 2 * m + 2) for m in range(2)]
    local_first = reference_grads(model, x[micro[0]], y[micro[0]])
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(overlap_grad_reduce=True), model, pg_collection=pgc
    )
    with ddp.no_sync():
        (mse(ddp, x[micro[0]], y[micro[0]]) / 2).backward()
    for name, param in model.named_parameters():  # nothing was reduced or scaled yet
        torch.testing.assert_close(param.main_grad, local_first[name] / 2, rtol=1e-5, atol=1e-6)
    (mse(ddp, x[micro[1]], y[micro[1]]) / 2).backward()
    ddp.finish_grad_sync()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-5, atol=1e-6)


def test_no_sync_accumulates_micro_batches_and_reduces_once():
    run_distributed(_no_sync_accumulates, 2)


def _per_token_loss_sums():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(2))
    model = tiny_mlp()
    x, y = batch(8)
    expected = reference_grads(model, x, y)
    ddp = DistributedDataParallel(
        ModelParallelConfig(calculate_per_token_loss=True), DistributedDataParallelConfig(), model, pg_collection=pgc
    )
    rank = pgc.rank("dp_cp")
    mse(ddp, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]).backward()
    ddp.finish_grad_sync()
    for name, param in model.named_parameters():  # sum of the two local means = 2 x global mean
        torch.testing.assert_close(param.main_grad, 2 * expected[name], rtol=1e-5, atol=1e-6)
    ddp.scale_gradients(0.5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-5, atol=1e-6)


def test_per_token_loss_sums_over_replicas_and_scale_gradients_divides():
    run_distributed(_per_token_loss_sums, 2)


def _broadcast_from_first_replica():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(2))
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Linear(3, 2).to(device())
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(use_distributed_optimizer=True), model, pg_collection=pgc
    )
    ddp.broadcast_params()
    torch.manual_seed(0)
    first = torch.nn.Linear(3, 2)
    torch.testing.assert_close(model.weight.detach().cpu(), first.weight.detach())
    torch.testing.assert_close(model.bias.detach().cpu(), first.bias.detach())


def test_broadcast_params_copies_the_first_replica():
    run_distributed(_broadcast_from_first_replica, 2)


def _buffer_dtypes_and_views():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(1))
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(device(), torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(
        ModelParallelConfig(bf16=True),
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        model,
        pg_collection=pgc,
    )
    (buffer,) = ddp.param_and_grad_buffers
    assert buffer.grad_data.dtype == torch.float32 and buffer.param_data.dtype == torch.bfloat16
    for name, param in model.named_parameters():
        assert param.main_grad.dtype == torch.float32
        start, _ = buffer.param_range(param)
        assert param.data_ptr() == buffer.param_data[start:].data_ptr()  # the param lives in the buffer
        torch.testing.assert_close(param.detach(), before[name], rtol=0, atol=0)
    model(torch.ones(2, 5, dtype=torch.bfloat16, device=device())).sum().backward()
    ddp.finish_grad_sync()
    torch.testing.assert_close(model.bias.main_grad, torch.full((3,), 2.0, device=device()))
    ddp.zero_grad_buffer()
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())


def test_bf16_params_with_fp32_grad_buffer_and_param_buffer_views():
    run_distributed(_buffer_dtypes_and_views, 1)


def test_bad_bucket_size_is_rejected():
    with pytest.raises(
        DistributedConfigError, match=r"bucket_size must be None \(the default size\) or an integer >= 1, got 0"
    ):
        DistributedDataParallelConfig(bucket_size=0)


def _late_gradient_is_rejected():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(2))
    model = tiny_mlp()
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(overlap_grad_reduce=True), model, pg_collection=pgc
    )
    x, y = batch(2)
    mse(ddp, x, y).backward()  # every bucket launched: the next backward is outside no_sync
    with pytest.raises(
        GradSyncOrderError,
        match=r"a gradient of shape \(3,\) arrived after its bucket's reduction "
        r"was launched: run every micro-batch but the last inside no_sync\(\)",
    ):
        mse(ddp, x, y).backward()


def test_gradient_after_its_bucket_was_launched_is_rejected():
    run_distributed(_late_gradient_is_rejected, 2)
