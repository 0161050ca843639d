"""The global gradient norm, zero count and parameter norm count every parameter exactly once
across TP, GTP, PP and DP: hand-sharded parameters on 4-8 gloo ranks against the
single-process values of the full model."""

import pytest
import torch

from megatron.core.config import ModelParallelConfig
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import device, run_distributed

# name: (global shape, pipeline stage, TP dim or None, GTP-sharded, tied-embedding copy)
SPECS = {
    "emb": ((8, 4), 0, 0, True, True),
    "col": ((8, 6), 0, 0, True, False),
    "norm": ((6,), 0, None, False, False),
    "a_log": ((4,), 1, 0, False, False),  # Mamba-like scalar: TP-sharded, GTP-replicated
    "row": ((4, 8), 1, 1, True, False),
    "bias": ((4,), 1, None, False, False),
    "emb_copy": ((8, 4), 1, 0, True, True),  # the last stage's copy of the tied embedding
}
MAX_NORM = 1.0


def full_tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(spec[0], generator=gen) for name, spec in SPECS.items() if name != "emb_copy"}
    tensors["emb_copy"] = tensors["emb"]  # tied: same weight, same (embd-summed) gradient
    return tensors


def full_grads():
    grads = full_tensors(seed=1)
    grads["col"][3] = 0.0  # known zeros for the zero count
    return grads


def reference():
    """Single process: torch's clip_grad_norm_ over the unique parameters, then SGD(lr=1)."""
    params = {name: torch.nn.Parameter(t.clone()) for name, t in full_tensors(seed=0).items() if name != "emb_copy"}
    grads = full_grads()
    for name, param in params.items():
        param.grad = grads[name].clone()
    num_zeros = sum(int((p.grad == 0).sum()) for p in params.values())
    norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM))
    with torch.no_grad():
        for param in params.values():
            param -= param.grad
    params["emb_copy"] = params["emb"]
    return norm, num_zeros, {name: p.detach() for name, p in params.items()}


def shard(tensor, spec, pgc):
    _, _, tp_dim, gtp_sharded, _ = spec
    if tp_dim is not None:
        tensor = tensor.chunk(pgc.size("tp"), tp_dim)[pgc.rank("tp")]
    if gtp_sharded:
        tensor = tensor.chunk(pgc.size("gtp"), 0)[pgc.rank("gtp")]
    return tensor.contiguous()


def stage_params(pgc):
    """This rank's shards of its stage's parameters, tagged like the parallel layers tag them."""
    params = torch.nn.ParameterDict()
    for name, full in full_tensors(seed=0).items():
        spec = SPECS[name]
        shape, stage, tp_dim, gtp_sharded, tied = spec
        if stage != pgc.rank("pp"):
            continue
        param = torch.nn.Parameter(shard(full, spec, pgc).to(device()))
        local_rows = shape[0] // pgc.size("tp") if tp_dim == 0 else shape[0]
        param.tensor_model_parallel, param.partition_dim = tp_dim is not None, -1 if tp_dim is None else tp_dim
        param.gtp_sharded, param.gtp_rows, param.global_shape = gtp_sharded, local_rows, shape
        param.sequence_parallel, param.shared_embedding = False, tied
        params[name] = param
    return params


def _global_norm_counts_each_param_once(world_size, sizes, distributed_optimizer):
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(world_size, **sizes))
    params = stage_params(pgc)
    config = OptimizerConfig(
        optimizer="sgd",
        lr=1.0,
        sgd_momentum=0.0,
        weight_decay=0.0,
        clip_grad=MAX_NORM,
        log_num_zeros_in_grad=True,
        use_distributed_optimizer=distributed_optimizer,
    )
    grads = full_grads()
    if distributed_optimizer:
        model = DistributedDataParallel(
            ModelParallelConfig(),
            DistributedDataParallelConfig(use_distributed_optimizer=True),
            params,
            pg_collection=pgc,
        )
        for name, param in params.items():
            param.main_grad.copy_(shard(grads[name], SPECS[name], pgc))
        model.finish_grad_sync()  # the mean of identical replica gradients
    else:
        model = params
        for name, param in params.items():
            param.grad = shard(grads[name], SPECS[name], pgc).to(device())
    optimizer = get_megatron_optimizer(config, [model], pgc)
    ok, norm, num_zeros = optimizer.step()

    ref_norm, ref_zeros, ref_params = reference()
    assert ok and ref_norm > MAX_NORM
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert num_zeros == ref_zeros
    for name, param in params.items():  # clipped by the global norm, so the update matches too
        torch.testing.assert_close(
            param.detach().cpu(), shard(ref_params[name], SPECS[name], pgc), rtol=1e-5, atol=1e-6
        )
    unique = [p.flatten() for name, p in ref_params.items() if name != "emb_copy"]
    assert optimizer.params_norm() == pytest.approx(float(torch.linalg.vector_norm(torch.cat(unique))), rel=1e-5)
    return norm


@pytest.mark.parametrize(
    "world_size, sizes, distributed_optimizer",
    [(8, dict(tp=2, gtp=2, pp=2), False), (4, dict(pp=2), True)],
    ids=["TP2xGTP2xPP2", "DP2xPP2-distributed-optimizer"],
)
def test_global_norm_equals_single_process_norm(world_size, sizes, distributed_optimizer):
    norms = run_distributed(_global_norm_counts_each_param_once, world_size, world_size, sizes, distributed_optimizer)
    assert len(set(norms)) == 1  # every rank reports the same norm
