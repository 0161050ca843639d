"""The load-balanced CP layout (chunks r and 2c-1-r), its inverse, the ring's per-step masks
(every causal chunk pair computed exactly once, equal work per rank) and the local block
attention kernels against SDPA."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.errors import MegatronConfigError, MegatronInputError
from megatron.core.transformer.context_parallel import (
    ContextParallelInputError,
    get_batch_on_this_cp_rank,
    shard_sequence,
    unshard_sequence,
)
from megatron.core.transformer.context_parallel.block_attention import (
    SdpaBlockAttention,
    TorchBlockAttention,
    get_block_attention,
)
from megatron.core.transformer.context_parallel.ring_attention import ring_plan
from megatron.core.transformer.context_parallel.sharding import chunk_ids, natural_order_index


def test_each_rank_holds_chunks_r_and_2c_minus_1_minus_r():
    tokens = torch.arange(16).unsqueeze(0)
    assert shard_sequence(tokens, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(tokens, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard_sequence(tokens, 3, 4).tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_unsharding_every_rank_part_restores_the_sequence(cp_size):
    seq = torch.randn(3, 24, 5)
    pieces = [shard_sequence(seq, rank, cp_size, seq_dim=1) for rank in range(cp_size)]
    assert all(p.shape == (3, 24 // cp_size, 5) for p in pieces)
    assert torch.equal(unshard_sequence(pieces, seq_dim=1), seq)
    gathered = torch.cat(pieces, dim=1)  # what an all-gather in rank order holds
    assert torch.equal(gathered.index_select(1, natural_order_index(cp_size, 24 // (2 * cp_size))), seq)


def test_a_sequence_that_does_not_split_into_2c_chunks_is_refused():
    with pytest.raises(
        ContextParallelInputError, match="sequence length 12 must be divisible by 2 x context_parallel_size = 8"
    ):
        shard_sequence(torch.zeros(1, 12), 0, 4)
    assert issubclass(ContextParallelInputError, MegatronInputError)


def test_without_a_cp_group_the_batch_is_untouched():
    batch = {"tokens": torch.arange(8).view(1, 8)}
    assert get_batch_on_this_cp_rank(batch, None) is batch


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_ring_steps_compute_every_causal_chunk_pair_once_with_equal_work(cp_size):
    chunk = 4
    seen = {}
    work = []
    for rank in range(cp_size):
        q_chunks = chunk_ids(rank, cp_size)
        steps = ring_plan(rank, cp_size, chunk)
        assert [s.source for s in steps] == [(rank - i) % cp_size for i in range(cp_size)]
        for step in steps:
            kv_chunks = chunk_ids(step.source, cp_size)
            for qi in range(step.q_rows.start // chunk, step.q_rows.stop // chunk):
                for ki in range(step.kv_rows.start // chunk, step.kv_rows.stop // chunk):
                    pair = (q_chunks[qi], kv_chunks[ki])
                    if step.causal and ki > qi:
                        continue  # masked out entirely by the causal mask of the local block
                    assert pair not in seen, pair
                    seen[pair] = step.causal and qi == ki
        work.append(sum(step.chunk_pairs(chunk) for step in steps))
    causal_pairs = {(i, j): i == j for i in range(2 * cp_size) for j in range(i + 1)}
    assert seen == causal_pairs  # each visible pair once; diagonal pairs (only) causally masked
    assert max(work) - min(work) <= 1
    assert sum(work) == pytest.approx(2 * cp_size * (2 * cp_size + 1) / 2 - cp_size)  # pairs, diagonal halved


def _qkv(causal_len=12, heads=4, groups=2, dtype=torch.float64):
    torch.manual_seed(0)
    q = torch.randn(2, heads, causal_len, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, groups, causal_len, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, groups, causal_len, 8, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("kernel", [TorchBlockAttention(), SdpaBlockAttention()], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_matches_sdpa_forward_backward_and_lse(kernel, causal):
    q, k, v = _qkv()
    scale = 0.3
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    out, lse, aux = kernel.forward(q.detach(), k.detach(), v.detach(), causal, scale)
    scores = (q.detach() @ k.detach().repeat_interleave(2, dim=1).transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=1e-6, atol=1e-6)
    grads = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, aux, causal, scale)
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_with_dropout_is_autograd_of_the_dropped_probabilities(causal):
    """The dropout mask the block draws from its seed, applied to softmax probabilities by hand
    and differentiated by autograd: the kernel's output, its undropped log-sum-exp and its
    gradients (the mask drawn again in backward)."""
    q, k, v = _qkv()
    scale, dropout = 0.3, (0.25, 1234)
    k_x, v_x = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k_x.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    grouped = probs.view(2, 2, 2, 12, 12)  # the kernel's [b, groups, heads per group, sq, sk] mask layout
    kept = TorchBlockAttention._kept(grouped.detach(), dropout).view(2, 4, 12, 12)
    assert 0.6 < (kept > 0).double().mean() < 0.9 and set(kept.unique().tolist()) == {0.0, 1 / 0.75}
    expected = (probs * kept) @ v_x
    dout = torch.randn_like(expected)
    expected.backward(dout)
    kernel = TorchBlockAttention()
    out, lse, aux = kernel.forward(q.detach(), k.detach(), v.detach(), causal, scale, dropout)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores.detach(), -1), rtol=1e-6, atol=1e-6)
    grads = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, aux, causal, scale)
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_block_attention_backend_choice():
    assert get_block_attention(torch.device("cpu"), torch.float32).name == "torch"
    assert get_block_attention(torch.device("cpu"), torch.bfloat16, "sdpa").name == "sdpa"
    assert get_block_attention(torch.device("cuda"), torch.bfloat16, dropout=True).name == "torch"
    with pytest.raises(
        MegatronConfigError, match="unknown block attention backend 'flash'; accepted: auto, torch, sdpa"
    ):
        get_block_attention(torch.device("cpu"), torch.float32, "flash")


def test_cp_comm_type_is_validated():
    with pytest.raises(ConfigError, match="cp_comm_type must be 'p2p' or 'all_gather', got 'a2a'"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, cp_comm_type="a2a")
