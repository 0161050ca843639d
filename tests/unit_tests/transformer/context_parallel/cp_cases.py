"""Bodies of the multi-process CP tests (run on CP2 and CP4 worlds by the test files): ring and
all-gather attention against SDPA on the whole sequence, a model's gradients at CP = c against
CP = 1, and the attention work each rank does inside a real model."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.transformer import attention
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank, shard_sequence
from megatron.core.transformer.context_parallel.block_attention import (
    SdpaBlockAttention,
    TorchBlockAttention,
)
from megatron.core.transformer.context_parallel.ring_attention import context_parallel_attention
from megatron.training.training import loss_func
from tests.unit_tests.dist_harness import device

VOCAB, SEQ = 64, 32
KERNELS = {"torch": TorchBlockAttention, "sdpa": SdpaBlockAttention}


def collection(**sizes) -> ProcessGroupCollection:
    return ProcessGroupCollection.from_layout(RankLayout.for_world(dist.get_world_size(), **sizes))


def attention_against_sdpa(comm_type: str, kernel: str) -> tuple[float, float]:
    """(largest difference of this rank's output and q/k/v gradients from SDPA over the whole
    sequence (causal, GQA), the tolerance of the dtype): fp64, or bf16 for the fused kernel on CUDA
    (where its flash kernels run; the reference then computes in fp32 from the same inputs)."""
    group = dist.group.WORLD
    rank, cp = dist.get_rank(), dist.get_world_size()
    fused_on_gpu = kernel == "sdpa" and device().type == "cuda"
    dtype, tolerance = (torch.bfloat16, 5e-2) if fused_on_gpu else (torch.float64, 1e-12)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 8 * cp, 8).to(device(), dtype).requires_grad_() for h in (4, 2, 2))
    full = [t.detach().float().requires_grad_() for t in (q, k, v)] if fused_on_gpu else [q, k, v]
    expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True, scale=0.3)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    local = [shard_sequence(t.detach(), rank, cp, seq_dim=2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group, comm_type, 0.3, KERNELS[kernel]())
    out.backward(shard_sequence(dout.to(dtype), rank, cp, seq_dim=2))
    errors = [(out - shard_sequence(expected.detach(), rank, cp, seq_dim=2)).abs().max()]
    errors += [
        (mine.grad - shard_sequence(whole.grad, rank, cp, seq_dim=2)).abs().max()
        for mine, whole in zip(local, full, strict=True)
    ]
    return max(e.item() for e in errors), tolerance


def model_config(family: str, pg: ProcessGroupCollection, **overrides) -> TransformerConfig:
    fields = dict(
        num_layers=4 if family == "hybrid" else 2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        mamba_head_dim=8,
        mamba_state_dim=8,
        mamba_num_groups=4,
        mamba_chunk_size=4,
        init_method_std=0.1,
        tensor_model_parallel_size=pg.size("tp"),
        context_parallel_size=pg.size("cp"),
    )
    return TransformerConfig(**(fields | overrides))


def build_model(family: str, pg: ProcessGroupCollection, **overrides):
    config = model_config(family, pg, **overrides)
    if family == "gpt":
        return GPTModel(
            config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope", pg_collection=pg
        )
    return HybridModel(
        config,
        get_hybrid_stack_local_spec(),
        VOCAB,
        SEQ,
        hybrid_layer_pattern="M*M-",
        position_embedding_type="rope",
        pg_collection=pg,
    )


def batch() -> dict:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
    loss_mask = (torch.rand(2, SEQ, generator=generator) > 0.2).float()
    positions = torch.arange(SEQ).expand(2, SEQ)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask, "position_ids": positions}


def loss_and_gradients(family: str, cp: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Per-token mean loss of one micro-batch and every parameter's gradient summed over CP
    (what DDP reduces over ``dp_cp``, up to its 1/|dp_cp|)."""
    pg = collection(cp=cp)
    model = build_model(family, pg).to(device())
    cp_group = pg.cp if cp > 1 else None
    mine = get_batch_on_this_cp_rank({key: t.to(device()) for key, t in batch().items()}, cp_group)
    losses = model(mine["tokens"], mine["position_ids"], labels=mine["labels"])
    loss, _ = loss_func(mine["loss_mask"], losses, cp_group=cp_group)
    (loss / cp).backward()  # the 1/|dp_cp| DDP applies
    reported = loss.detach() / cp
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if cp > 1:
            dist.all_reduce(grad, group=pg.cp)
        grads[name] = grad.cpu()
    if cp > 1:
        dist.all_reduce(reported, group=pg.cp)
    return reported.item(), grads


class _CountingKernel:
    """The real torch block kernel, recording each forward block's query/key lengths."""

    name = "counting"

    def __init__(self, calls):
        self.inner, self.calls = TorchBlockAttention(), calls

    def forward(self, q, k, v, causal, scale, dropout=None):
        self.calls.append((q.shape[2], k.shape[2], causal))
        return self.inner.forward(q, k, v, causal, scale, dropout)

    def backward(self, *args):
        return self.inner.backward(*args)


def attention_work_per_rank(monkeypatch_target=attention) -> tuple[list[int], float]:
    """Run a GPT forward and backward at CP = world size; return the sequence lengths the core
    attention of each layer received and this rank's causal work of the first layer in chunk
    pairs (a causal block counts half its pairs)."""
    cp = dist.get_world_size()
    calls, lengths = [], []
    original = monkeypatch_target.get_block_attention
    monkeypatch_target.get_block_attention = lambda device, dtype, dropout=False: _CountingKernel(calls)
    try:
        pg = collection(cp=cp)
        model = build_model("gpt", pg).to(device())
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.register_forward_pre_hook(
                lambda _, args: lengths.append(args[0].shape[0])
            )
        mine = get_batch_on_this_cp_rank({key: t.to(device()) for key, t in batch().items()}, pg.cp)
        model(mine["tokens"], mine["position_ids"], labels=mine["labels"]).sum().backward()
    finally:
        monkeypatch_target.get_block_attention = original
    chunk = SEQ // (2 * cp)
    first_layer = calls[:cp]
    work = sum(sq * sk / (2 if causal else 1) for sq, sk, causal in first_layer) / chunk**2
    return lengths, work


def default_positions_are_global(family: str) -> bool:
    """Whether a forward without position ids equals one given the sharded global positions."""
    pg = collection(cp=dist.get_world_size())
    model = build_model(family, pg).to(device())
    mine = get_batch_on_this_cp_rank({key: t.to(device()) for key, t in batch().items()}, pg.cp)
    with torch.no_grad():
        given = model(mine["tokens"], mine["position_ids"], labels=mine["labels"])
        derived = model(mine["tokens"], labels=mine["labels"])
    return torch.equal(given, derived)
