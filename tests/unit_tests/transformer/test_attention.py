"""SelfAttention (GQA, causal, RoPE) against a hand-written attention; the inference hook."""

import math

import torch

from megatron.core.config import TransformerConfig
from megatron.core.transformer.attention import (
    AttentionInferenceContext,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb
from tests.unit_tests.transformer.single_rank import on_single_rank

S, B, H, HEADS, GROUPS = 5, 2, 32, 4, 2
D = H // HEADS


def config(**kw):
    return TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, add_bias_linear=True, **kw
    )


def hand_attention(attn: SelfAttention, x, rotary=None, causal=True):
    qkv = x @ attn.linear_qkv.weight.t() + attn.linear_qkv.bias
    q, k, v = qkv.split([HEADS * D, GROUPS * D, GROUPS * D], dim=-1)
    q, k, v = q.reshape(S, B, HEADS, D), k.reshape(S, B, GROUPS, D), v.reshape(S, B, GROUPS, D)
    if rotary is not None:
        q, k = apply_rotary_pos_emb(q, rotary), apply_rotary_pos_emb(k, rotary)
    out = torch.empty(S, B, HEADS, D)
    for head in range(HEADS):
        group = head // (HEADS // GROUPS)  # consecutive query heads share a key/value group
        scores = torch.einsum("sbd,tbd->bst", q[:, :, head], k[:, :, group]) / math.sqrt(D)
        if causal:
            scores = scores.masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))
        out[:, :, head] = torch.einsum("bst,tbd->sbd", scores.softmax(-1), v[:, :, group])
    return out.reshape(S, B, H) @ attn.linear_proj.weight.t()


@on_single_rank
def test_gqa_causal_attention_with_rope_matches_hand_computation(pg):
    attn = SelfAttention(config(), SelfAttentionSubmodules(), layer_number=1, pg_collection=pg)
    x = torch.randn(S, B, H)
    rotary = RotaryEmbedding(D)(torch.arange(S)[None].expand(B, S))
    out, bias = attn(x, rotary_pos_emb=rotary)
    torch.testing.assert_close(out, hand_attention(attn, x, rotary), rtol=1e-5, atol=1e-5)
    assert bias is attn.linear_proj.bias  # returned unadded for bias-dropout-add


@on_single_rank
def test_interleaved_rope_is_the_halves_rope_of_queries_and_keys_with_permuted_channels(pg):
    """A query/key head's channels (0, 2, 4, ... | 1, 3, 5, ...) under the halves layout turn as
    (0, 1), (2, 3), ... do under the interleaved one: permuting the rows of Q and K that way in
    the projection gives the same attention output (the permutation of checkpoint converters)."""
    x = torch.randn(S, B, H, requires_grad=True)
    rotary = RotaryEmbedding(D)(torch.arange(S)[None].expand(B, S))
    interleaved = SelfAttention(config(rotary_interleaved=True), SelfAttentionSubmodules(), 1, pg_collection=pg)
    halves = SelfAttention(config(), SelfAttentionSubmodules(), layer_number=1, pg_collection=pg)
    per_head = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    qk_rows = torch.cat([head * D + per_head for head in range(HEADS + GROUPS)])
    rows = torch.cat([qk_rows, torch.arange((HEADS + GROUPS) * D, (HEADS + 2 * GROUPS) * D)])
    with torch.no_grad():
        halves.linear_qkv.weight.copy_(interleaved.linear_qkv.weight[rows])
        halves.linear_qkv.bias.copy_(interleaved.linear_qkv.bias[rows])
        halves.linear_proj.weight.copy_(interleaved.linear_proj.weight)
        halves.linear_proj.bias.copy_(interleaved.linear_proj.bias)
    out, _ = interleaved(x, rotary_pos_emb=rotary)
    want, _ = halves(x, rotary_pos_emb=rotary)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    same_weights_halves = SelfAttention(config(), SelfAttentionSubmodules(), layer_number=1, pg_collection=pg)
    same_weights_halves.load_state_dict(interleaved.state_dict())
    other, _ = same_weights_halves(x, rotary_pos_emb=rotary)
    assert (out - other).abs().max() > 1e-3 * out.abs().max()  # the layouts are different models
    (grad,) = torch.autograd.grad(out.sum(), x)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)


@on_single_rank
def test_explicit_mask_replaces_the_causal_mask(pg):
    attn = SelfAttention(config(), SelfAttentionSubmodules(), layer_number=1, pg_collection=pg)
    x = torch.randn(S, B, H)
    nothing_masked = torch.zeros(B, 1, S, S, dtype=torch.bool)
    out, _ = attn(x, attention_mask=nothing_masked)
    torch.testing.assert_close(out, hand_attention(attn, x, causal=False), rtol=1e-5, atol=1e-5)


@on_single_rank
def test_inference_context_supplies_the_attention(pg):
    attn = SelfAttention(config(), SelfAttentionSubmodules(), layer_number=7, pg_collection=pg)

    class Recording:
        def store_kv_and_attend(self, layer_number, q, k, v):
            self.call = (layer_number, q.shape, k.shape, v.shape)
            return torch.ones_like(q)

    context = Recording()
    assert isinstance(context, AttentionInferenceContext)
    out, _ = attn(torch.randn(S, 1, H), inference_context=context)
    assert context.call == (7, (S, 1, HEADS, D), (S, 1, GROUPS, D), (S, 1, GROUPS, D))
    torch.testing.assert_close(out, torch.ones(S, 1, H) @ attn.linear_proj.weight.t())


def test_gqa_through_enable_gqa_has_the_gradients_of_repeated_heads():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 9, 8, generator=gen, requires_grad=True) for n in (HEADS, GROUPS, GROUPS))
    cotangent = torch.randn(2, HEADS, 9, 8, generator=gen)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(HEADS // GROUPS, 1), v.repeat_interleave(HEADS // GROUPS, 1), is_causal=True
    )
    want = torch.autograd.grad(repeated, (q, k, v), cotangent)
    shared = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = torch.autograd.grad(shared, (q, k, v), cotangent)
    assert torch.equal(shared, repeated)  # the forward is bitwise the same
    for a, b in zip(got, want, strict=True):  # the backward sums the shared heads in another order
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
