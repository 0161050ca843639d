"""Expert gradients reduce over ``expt_dp``, dense ones over ``dp_cp``; the grad norm counts
each expert once; the distributed optimizer shards experts over ``expt_dp``. The reference is
one process running the full batch through every expert.

The toy expert layer follows the MoE layer's contract (``weight1`` [local experts, hidden,
ffn], ``weight2`` [local experts, ffn, hidden], ``is_expert``, ``local_expert_offset``). Its
"dispatch" gathers the EP group's tokens and runs those routed to local experts: the
gradient that reaches an expert is then exactly what an all-to-all dispatcher's backward
delivers (the sum over the EP group's tokens routed to it).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.config import ModelParallelConfig
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import run_distributed

HIDDEN, FFN, NUM_EXPERTS, TOKENS_PER_RANK, WORLD = 4, 6, 4, 8, 4


class ToyExperts(torch.nn.Module):
    def __init__(self, ep_rank: int, ep_size: int):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        full1 = torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=gen) * 0.5
        full2 = torch.randn(NUM_EXPERTS, FFN, HIDDEN, generator=gen) * 0.5
        self.num_local_experts = NUM_EXPERTS // ep_size
        self.local_expert_offset = ep_rank * self.num_local_experts
        local = slice(self.local_expert_offset, self.local_expert_offset + self.num_local_experts)
        self.weight1 = torch.nn.Parameter(full1[local].clone())
        self.weight2 = torch.nn.Parameter(full2[local].clone())
        for param in (self.weight1, self.weight2):
            param.is_expert = True

    def forward(self, tokens, expert_of_token):
        """Sum over tokens routed to local experts of half the squared expert output."""
        total = tokens.new_zeros(())
        for local in range(self.num_local_experts):
            routed = tokens[expert_of_token == self.local_expert_offset + local]
            out = torch.nn.functional.gelu(routed @ self.weight1[local]) @ self.weight2[local]
            total = total + 0.5 * out.square().sum()
        return total


class ToyMoE(torch.nn.Module):
    def __init__(self, ep_rank=0, ep_size=1):
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(HIDDEN, HIDDEN)
        self.experts = ToyExperts(ep_rank, ep_size)
        self.router = torch.randn(HIDDEN, NUM_EXPERTS, generator=torch.Generator().manual_seed(2))


def tokens_of(rank, step):
    return torch.randn(TOKENS_PER_RANK, HIDDEN, generator=torch.Generator().manual_seed(100 * step + rank))


def rank_loss(model, tokens, ep_tokens):
    """Dense loss (mean over ``tokens``) plus the expert term ``ep_tokens`` put on the local
    experts, each token's expert loss divided by the number of ``tokens`` (as in its own
    rank's mean)."""
    dense = torch.tanh(model.dense(tokens)).square().sum(-1).mean()
    routed = (ep_tokens @ model.router).argmax(-1)
    return dense + model.experts(ep_tokens, routed) / len(tokens)


def reference_step(step, lr, clip):
    """Single process, full batch: gradients of the global mean loss, their norm, one SGD step."""
    model = ToyMoE()
    everything = torch.cat([tokens_of(r, step) for r in range(WORLD)])
    rank_loss(model, everything, everything).backward()  # the mean over all tokens
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values())).item()
    factor = min(1.0, clip / (norm + 1e-6))
    params = {name: (p - lr * factor * p.grad).detach() for name, p in model.named_parameters()}
    return grads, norm, params


def _check(sizes, variants):
    layout = RankLayout.for_world(WORLD, **sizes)
    pgc = ProcessGroupCollection.from_layout(layout)
    ep_rank = pgc.rank("ep")
    lr, clip = 0.1, 0.05
    grads, norm, stepped = reference_step(0, lr, clip)
    me = dist.get_rank()
    mine = ToyMoE(ep_rank, pgc.size("ep"))
    local = slice(mine.experts.local_expert_offset, mine.experts.local_expert_offset + mine.experts.num_local_experts)
    tokens = tokens_of(me, 0)
    if pgc.has("ep"):
        gathered = [torch.empty_like(tokens) for _ in range(pgc.size("ep"))]
        dist.all_gather(gathered, tokens, group=pgc.ep)
        ep_tokens = torch.cat(gathered)
    else:
        ep_tokens = tokens
    results = {}
    for distributed_optimizer, overlap in variants:
        model = ToyMoE(ep_rank, pgc.size("ep"))
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=overlap, bucket_size=40
        )
        ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model, pg_collection=pgc)
        config = OptimizerConfig(
            optimizer="sgd", lr=lr, sgd_momentum=0.0, weight_decay=0.0, clip_grad=clip,
            use_distributed_optimizer=distributed_optimizer,
        )  # fmt: skip
        optimizer = get_megatron_optimizer(config, ddp, pgc)
        rank_loss(model, tokens, ep_tokens).backward()
        ddp.finish_grad_sync()
        expected = {name: g[local] if name.startswith("experts.") else g for name, g in grads.items()}
        if not distributed_optimizer:  # sharded buffers hold the reduced values on owned shards only
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.main_grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)
        ok, grad_norm, _ = optimizer.step()
        assert ok and abs(grad_norm - norm) < 1e-5 * norm, (grad_norm, norm)
        for name, param in model.named_parameters():
            want = stepped[name][local] if name.startswith("experts.") else stepped[name]
            torch.testing.assert_close(param.detach(), want, rtol=1e-6, atol=1e-7, msg=name)
        if distributed_optimizer:
            owned = {True: 0, False: 0}
            for param, start, end in optimizer.shard_ranges():
                owned[bool(getattr(param, "is_expert", False))] += end - start
            counts = torch.tensor([owned[True], owned[False]])
            expert_total, dense_total = counts.clone(), counts.clone()
            dist.all_reduce(expert_total, group=pgc.expert_dp_group())
            dist.all_reduce(dense_total, group=pgc.dp_cp)
            results["expert_state_numel"] = expert_total[0].item()
            results["dense_state_numel"] = dense_total[1].item()
        results[(distributed_optimizer, overlap)] = grad_norm
    return results


VARIANTS = [(False, False), (False, True), (True, False), (True, True)]


@pytest.mark.parametrize("sizes", [dict(ep=2, etp=1), dict(ep=4, etp=1)], ids=["EP2xEDP2", "EP4"])
def test_expert_grads_reduce_over_expert_data_parallel_and_match_full_batch(sizes):
    results = run_distributed(_check, WORLD, sizes, VARIANTS)
    local_experts = NUM_EXPERTS // sizes["ep"]
    for result in results:
        # the distributed optimizer's shards cover each local expert once over expt_dp, and
        # each dense parameter once over dp_cp
        assert result["expert_state_numel"] == local_experts * 2 * HIDDEN * FFN
        assert result["dense_state_numel"] == HIDDEN * HIDDEN + HIDDEN
        # overlap changes when buckets reduce, not what: equal norms bit for bit
        assert result[(False, False)] == result[(False, True)] and result[(True, False)] == result[(True, True)]
