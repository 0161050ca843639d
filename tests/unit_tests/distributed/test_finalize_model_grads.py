"""finalize_model_grads: GTP-replicated grads averaged (or summed per token) over gtp,
sequence-parallel grads summed over tp, tied embedding grads summed over the embd group,
GTP-sharded weights left alone."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import finalize_model_grads
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_full_grad,
    gather_full_parameter,
    init_rng_scope,
    set_parallel_attributes,
)
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.tensor_parallel.helpers import collection, data_seed, gtp_peer_seeds, tp_config


class Chunk(torch.nn.Module):
    """One parameter of each kind, each with gradient (rank + 1) * ones."""

    def __init__(self, shared_embedding=False):
        super().__init__()
        self.replicated = torch.nn.Parameter(torch.zeros(3))  # norm weight / bias: gtp_sharded False
        set_parallel_attributes(self.replicated, tensor_model_parallel=False, partition_dim=-1, global_shape=(3,))
        self.sequence_parallel = torch.nn.Parameter(torch.zeros(2))
        set_parallel_attributes(
            self.sequence_parallel,
            tensor_model_parallel=False,
            partition_dim=-1,
            global_shape=(2,),
            sequence_parallel=True,
        )
        self.sharded = torch.nn.Parameter(torch.zeros(2, 2))
        set_parallel_attributes(
            self.sharded, tensor_model_parallel=True, partition_dim=0, global_shape=(8, 2), gtp_sharded=True, gtp_rows=4
        )
        self.untagged = torch.nn.Parameter(torch.zeros(1))  # a plain torch parameter counts as replicated
        self.frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        if shared_embedding:
            self.word_embeddings = torch.nn.Parameter(torch.zeros(2))
            self.word_embeddings.gtp_sharded = True  # isolate the embd reduction
            self.word_embeddings.shared_embedding = True
        self.to(device())
        for p in self.parameters():
            p.grad = torch.full_like(p, dist.get_rank() + 1.0)


def group_values(group):
    return [r + 1.0 for r in dist.get_process_group_ranks(group)]


def _finalize(tp, g, pp, per_token, sequence_parallel):
    pg = collection(tp=tp, gtp=g, pp=pp)
    chunk = Chunk(shared_embedding=pp > 1)
    config = tp_config(
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, calculate_per_token_loss=per_token
    )
    finalize_model_grads([chunk], pg, config)
    me = dist.get_rank() + 1.0
    gtp_peers = group_values(pg.gtp) if g > 1 else [me]
    gtp_reduce = (lambda vals: sum(vals)) if per_token else (lambda vals: sum(vals) / len(vals))
    expected = {
        "replicated": gtp_reduce(gtp_peers),
        "untagged": gtp_reduce(gtp_peers),
        "sharded": me,
        "frozen": None,
    }

    # sequence-parallel: summed over tp (tp is the fastest axis) and reduced over gtp, in either order
    def tp_sum(rank):
        return sum(rank - rank % tp + i + 1.0 for i in range(tp))

    gtp_ranks = dist.get_process_group_ranks(pg.gtp) if g > 1 else [dist.get_rank()]
    expected["sequence_parallel"] = gtp_reduce([tp_sum(r) for r in gtp_ranks])
    if pp > 1:
        expected["word_embeddings"] = sum(group_values(pg.embd))
    for name, p in chunk.named_parameters():
        if expected[name] is None:
            assert p.grad.eq(me).all(), name  # frozen parameters are not touched
        else:
            torch.testing.assert_close(p.grad, torch.full_like(p, expected[name]), msg=name)
    return True


@pytest.mark.parametrize(
    "tp,g,pp,per_token",
    [(2, 2, 1, False), (2, 2, 1, True), (1, 2, 2, False), (1, 1, 1, False)],
    ids=["tp2xgtp2-mean", "tp2xgtp2-per-token", "gtp2xpp2-tied", "single"],
)
def test_finalize_reduces_each_parameter_kind_over_its_group(tp, g, pp, per_token):
    world = tp * g * pp
    assert run_distributed(_finalize, world, tp, g, pp, per_token, True) == [True] * world


def test_missing_grads_become_zeros_and_main_grad_is_preferred():
    def run():
        pg = collection(gtp=2)
        dev = device()
        a, b = torch.nn.Parameter(torch.zeros(2, device=dev)), torch.nn.Parameter(torch.zeros(2, device=dev))
        b.main_grad = torch.full((2,), 2.0 * (dist.get_rank() + 1), device=dev)
        b.grad = torch.full((2,), 100.0, device=dev)  # ignored: DDP's main_grad is the gradient
        module = torch.nn.Module()
        module.a, module.b = a, b
        finalize_model_grads(module, pg, tp_config())
        return a.grad.tolist(), b.main_grad.tolist(), b.grad.tolist()

    assert run_distributed(run, 2) == [([0.0, 0.0], [3.0, 3.0], [100.0, 100.0])] * 2


def _layers_with_sequence_parallel_and_gtp():
    """Column -> gelu -> Row under TP2 x GTP2 with sequence parallelism: after finalize every
    gathered grad (sharded weights, TP-sliced and whole biases) is the GTP-peer mean of the
    single-process full-sequence grads."""
    pg = collection(tp=2, gtp=2)
    config = tp_config(tensor_model_parallel_size=2, sequence_parallel=True)
    with init_rng_scope(config, "layer1"):
        fc1 = ColumnParallelLinear(4, 6, config=config, init_method=torch.nn.init.normal_, pg_collection=pg)
        fc2 = RowParallelLinear(6, 4, config=config, init_method=torch.nn.init.normal_, pg_collection=pg)
    model = torch.nn.ModuleList([fc1, fc2]).to(device())
    with torch.no_grad():
        fc1.bias.copy_(torch.linspace(-1, 1, 3))
    full = {name: gather_full_parameter(p, pg).cpu() for name, p in model.named_parameters()}

    def reference_grads(seed):
        x = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(seed))
        params = {k: v.clone().requires_grad_(True) for k, v in full.items()}
        h = torch.nn.functional.gelu(x @ params["0.weight"].t() + params["0.bias"])
        y = h @ params["1.weight"].t() + params["1.bias"]
        (y * y).sum().backward()
        return x, {k: v.grad for k, v in params.items()}

    x, _ = reference_grads(data_seed(2))
    x_local = x.chunk(2, dim=0)[pg.rank("tp")].to(device())  # sequence parallel input
    y = fc2(torch.nn.functional.gelu(fc1(x_local)[0]))[0]
    (y * y).sum().backward()
    finalize_model_grads([model], pg, config)

    peers = [reference_grads(s)[1] for s in gtp_peer_seeds(pg, 2)]
    for name, param in model.named_parameters():
        expected = sum(p[name] for p in peers) / len(peers)
        torch.testing.assert_close(gather_full_grad(param, pg).cpu(), expected, rtol=1e-5, atol=1e-5, msg=name)
    return True


def test_parallel_layers_with_sequence_parallel_and_gtp_get_the_mean_full_gradient():
    assert run_distributed(_layers_with_sequence_parallel_and_gtp, 4) == [True] * 4
