"""Tiny models, batches and single-process references shared by the optimizer tests."""

import copy

import torch

from megatron.core.config import ModelParallelConfig
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import device

ADAM = dict(lr=0.01, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-8)


def tiny_mlp(dtype=torch.float32, seed=0):
    """Linear(4, 8) -> tanh -> Linear(8, 3): 67 parameters, two of them 1-D biases."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model.to(device(), dtype)


def batch(num_rows, step=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(num_rows, 4, generator=gen), torch.randn(num_rows, 3, generator=gen)
    return x.to(device(), dtype), y.to(device(), dtype)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def dp_collection(world_size):
    return ProcessGroupCollection.from_layout(RankLayout.for_world(world_size))


def wrap_ddp(model, pgc, distributed_optimizer=False, bucket_size=None, grad_reduce_in_fp32=False):
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_size,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )
    return DistributedDataParallel(ModelParallelConfig(), ddp_config, model, pg_collection=pgc)


def train_dp(ddp, optimizer, pgc, steps, rows_per_rank=4):
    """``steps`` iterations on this rank's slice of each global batch; returns the step results."""
    rank, results = pgc.rank("dp_cp"), []
    dtype = next(ddp.parameters()).dtype
    for step in range(steps):
        x, y = batch(rows_per_rank * pgc.size("dp_cp"), step, dtype)
        rows = slice(rows_per_rank * rank, rows_per_rank * (rank + 1))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.scale_loss(loss_fn(ddp, x[rows], y[rows])).backward()
        ddp.finish_grad_sync()
        results.append(optimizer.step())
    return results


def torch_adamw(params, lr, weight_decay, adam_beta1, adam_beta2, adam_eps, no_decay=lambda p: p.dim() == 1):
    """The reference: torch AdamW with weight decay off for 1-D params."""
    params = list(params)
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if not no_decay(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if no_decay(p)], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(adam_beta1, adam_beta2),
        eps=adam_eps,
    )


def reference_training(model, world_rows, steps, clip_grad, adam=ADAM):
    """Single-process full-batch training of a fp32 copy of ``model``; returns it and its norms."""
    ref = copy.deepcopy(model).float()
    opt = torch_adamw(ref.parameters(), **adam)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(world_rows, step)
        loss_fn(ref, x, y).backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_grad if clip_grad > 0 else float("inf")))
        )
        opt.step()
    return ref, norms


def build(model, pgc, distributed_optimizer=False, bucket_size=None, fused=False, grad_reduce_in_fp32=False, **config):
    """DDP and our optimizer over ``model``; ``fused``: torch's fused AdamW, which CUDA masters
    get, also on CPU."""
    ddp = wrap_ddp(model, pgc, distributed_optimizer, bucket_size, grad_reduce_in_fp32)
    config = OptimizerConfig(**{**ADAM, **config, "use_distributed_optimizer": distributed_optimizer})
    optimizer = get_megatron_optimizer(config, [ddp], pgc)
    if fused:
        groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in optimizer.param_groups]
        optimizer.optimizer = torch.optim.AdamW(groups, fused=True)
    return ddp, optimizer


def dp2_grads(ddp, opt, pgc, step, nan: bool, dtype=torch.bfloat16) -> None:
    """This rank's half of global batch ``step`` through the model (``dtype``), gradients synced over DP2;
    ``nan``: a nan planted in the first parameter's synced gradient (as an all-reduce would spread
    it: every rank holds it)."""
    rank = pgc.rank("dp_cp")
    x, y = batch(8, step, dtype)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss_fn(ddp, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]).backward()
    ddp.finish_grad_sync()
    if nan:
        next(ddp.module.parameters()).main_grad.view(-1)[0] = float("nan")
