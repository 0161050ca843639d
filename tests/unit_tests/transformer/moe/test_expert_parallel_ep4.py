"""Expert parallelism on 4 gloo ranks: EP2 (two EP groups), EP4 and EP2 with ETP2 (experts'
ffn sharded over two ranks of other tokens), with the allgather and the alltoall dispatcher,
dropless. Each rank's output, input gradient and router gradient equal the EP1 layer with the
same global weights on that rank's tokens; each local expert shard's gradient equals the EP1
gradient summed over the tokens of its EP x ETP group, sliced to the shard."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.transformer.moe import MoELayer
from tests.unit_tests.dist_harness import run_distributed

WORLD = 4


def _config(dispatcher, bias=False):
    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        ffn_hidden_size=12,
        num_moe_experts=4,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=bias,
        moe_aux_loss_coeff=0.01,
        moe_token_dispatcher_type=dispatcher,
    )


def _tokens(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    # Skewed inputs so that experts get uneven (and some rank pairs no) tokens.
    return torch.randn(3, 2, 8, generator=generator) * (1 + rank), torch.randn(3, 2, 8, generator=generator)


def _build(config, pg):
    torch.manual_seed(7)  # the router's init; experts are drawn whole for every layout
    return MoELayer(config, pg_collection=pg).train()


def _run(x, grad, layer):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad)
    return out.detach(), x.grad


def _shard(full, name, etp_rank, etp_size):
    """The ETP shard of an EP1 expert tensor: weight1 / bias1 keep ``[gate_r; up_r]`` of their
    last dim, weight2 rows ``r`` of its ffn dim, bias2 is whole."""
    if name == "bias2" or etp_size == 1:
        return full
    if name == "weight2":
        return full.chunk(etp_size, 1)[etp_rank]
    gate, up = full.chunk(2, -1)
    return torch.cat([gate.chunk(etp_size, -1)[etp_rank], up.chunk(etp_size, -1)[etp_rank]], -1)


def _check_ep(ep_size, dispatcher, etp_size=1):
    """EP groups are consecutive ranks; with ETP the expt_tp peers are ranks ``ep_size`` apart
    (the expert layout keeps the EP groups, the peers hold the other ffn shard)."""
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(start, start + ep_size))) for start in range(0, WORLD, ep_size)]
    etp_groups = [dist.new_group(list(range(first, WORLD, ep_size))) for first in range(ep_size)]
    etp_rank = rank // ep_size if etp_size > 1 else 0
    span = ep_size * etp_size  # the EP x ETP group: consecutive ranks here
    members = range(rank - rank % span, rank - rank % span + span)
    config = _config(dispatcher, bias=etp_size > 1)
    pg = ProcessGroupCollection.from_layout(RankLayout.for_world(WORLD))
    dense = _build(config, pg)  # no ep group: EP 1, all experts
    pg.ep = groups[rank // ep_size]
    if etp_size > 1:
        pg.expt_tp = etp_groups[rank % ep_size]
    layer = _build(config, pg)
    assert layer.num_local_experts == 4 // ep_size and layer.local_expert_offset == (rank % ep_size) * 4 // ep_size

    x, grad = _tokens(rank)
    out, x_grad = _run(x, grad, layer)
    ref_out, ref_x_grad = _run(x, grad, dense)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.router.weight.grad, dense.router.weight.grad, rtol=1e-5, atol=1e-5)

    dense.zero_grad()
    for member in members:  # expert gradients collect every token of the EP x ETP group
        _run(*_tokens(member), dense)
    local = slice(layer.local_expert_offset, layer.local_expert_offset + layer.num_local_experts)
    for name in ("weight1", "weight2") + (("bias1", "bias2") if config.add_bias_linear else ()):
        ours, full = getattr(layer.experts, name), getattr(dense.experts, name)
        assert ours.is_expert
        assert getattr(ours, "tensor_model_parallel", False) == (etp_size > 1 and name != "bias2")
        torch.testing.assert_close(ours.detach(), _shard(full.detach()[local], name, etp_rank, etp_size))
        expected = _shard(full.grad[local], name, etp_rank, etp_size)
        torch.testing.assert_close(ours.grad, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("ep_size, etp_size", [(2, 1), (4, 1), (2, 2)], ids=["EP2", "EP4", "EP2xETP2"])
def test_expert_parallel_layer_equals_the_ep1_layer(ep_size, etp_size, dispatcher):
    run_distributed(_check_ep, WORLD, ep_size, dispatcher, etp_size)
