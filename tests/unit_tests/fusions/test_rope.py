"""RoPE fused into the QKV split against split + reshape + apply_rotary_pos_emb: GQA, partial
rotary, angles per batch row or broadcast, gradients arriving strided as attention returns
them; the torch path's one-buffer backward is bitwise the reference's."""

import pytest
import torch

from megatron.core.fusions import fusion_backend, split_qkv
from megatron.core.fusions.rope import split_qkv_reference
from megatron.core.inference.contexts.kv_cache import planes_of_one_tensor
from megatron.core.transformer.rope import RotaryEmbedding
from tests.unit_tests.fusions.kernels import DEVICE, assert_bitwise_equal, assert_triton_matches_torch, leaf

S, B = 6, 3


def _inputs(heads, groups, dim, rotary_percent, dtype, broadcast=False):
    gen = torch.Generator().manual_seed(0)
    qkv = leaf(S, B, (heads + 2 * groups) * dim, dtype=dtype, generator=gen)
    positions = torch.arange(S).unsqueeze(0) + 3 * torch.arange(B).unsqueeze(1)  # rows differ
    freqs = RotaryEmbedding(dim, rotary_percent)(positions).to(DEVICE)
    return qkv, freqs[:, :1] if broadcast else freqs


def _as_attention_sees_it(split):
    """q, k, v as attention consumes them: permuted to [b, n, s, d] (gradients come back strided)."""

    def fn(qkv, freqs, sizes):
        return tuple(t.permute(1, 2, 0, 3) for t in split(qkv, *sizes, freqs))

    return fn


SHAPES = [(4, 2, 8, 1.0), (3, 3, 12, 0.5), (2, 1, 6, 1.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, groups, dim, rotary_percent", SHAPES)
def test_fused_split_rotary_matches_reference(heads, groups, dim, rotary_percent, dtype):
    qkv, freqs = _inputs(heads, groups, dim, rotary_percent, dtype)
    fn = _as_attention_sees_it(split_qkv)
    assert_triton_matches_torch(lambda x: fn(x, freqs, (heads, groups, dim)), [qkv], dtype)


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("heads, groups, dim, rotary_percent", SHAPES)
def test_forward_only_torch_split_gives_the_reference_bits(heads, groups, dim, rotary_percent, broadcast):
    """The one-buffer forward path rotates q and k as one tensor: the reference's values exactly."""
    qkv, freqs = _inputs(heads, groups, dim, rotary_percent, torch.float32, broadcast)
    with fusion_backend("torch"), torch.no_grad():
        got = split_qkv(qkv, heads, groups, dim, freqs)
        want = split_qkv_reference(qkv, heads, groups, dim, freqs)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_angles_broadcast_over_the_batch():
    qkv, freqs = _inputs(4, 2, 8, 1.0, torch.float32, broadcast=True)
    assert_triton_matches_torch(lambda x: split_qkv(x, 4, 2, 8, freqs), [qkv], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, groups, dim, rotary_percent", SHAPES)
def test_torch_path_is_bitwise_the_reference(heads, groups, dim, rotary_percent, dtype):
    qkv, freqs = _inputs(heads, groups, dim, rotary_percent, dtype)
    sizes = (heads, groups, dim)
    ours, reference = _as_attention_sees_it(split_qkv), _as_attention_sees_it(split_qkv_reference)
    assert_bitwise_equal(lambda x: ours(x, freqs, sizes), lambda x: reference(x, freqs, sizes), [qkv])


def test_without_rotary_every_backend_returns_views_of_qkv():
    qkv, _ = _inputs(4, 2, 8, 1.0, torch.float32)
    with fusion_backend("triton"):
        q, k, v = split_qkv(qkv, 4, 2, 8)
    assert all(t._base is qkv for t in (q, k, v))
    assert torch.equal(v.reshape(S, B, -1), qkv[..., 6 * 8 :])


def test_forward_only_call_builds_no_graph():
    qkv, freqs = _inputs(4, 2, 8, 1.0, torch.float32)
    with fusion_backend("triton"), torch.inference_mode():
        q, k, v = split_qkv(qkv, 4, 2, 8, freqs)
    ref = split_qkv_reference(qkv, 4, 2, 8, freqs)
    assert q.grad_fn is None
    for got, want in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_forward_only_torch_path_reuses_angles_only_while_they_are_unchanged():
    """cos/sin are computed once for the angles every layer shares; new or edited angles (or
    another dtype) are never served stale ones."""
    qkv, freqs = _inputs(4, 2, 8, 1.0, torch.float32)
    qkv = qkv.detach()

    def check(qkv, freqs):
        with fusion_backend("torch"):
            got = split_qkv(qkv, 4, 2, 8, freqs)
        for a, b in zip(got, split_qkv_reference(qkv, 4, 2, 8, freqs), strict=True):
            assert torch.equal(a, b)

    check(qkv, freqs)
    check(qkv, freqs)  # served from the cache
    freqs.mul_(1.5)  # edited in place
    check(qkv, freqs)
    check(qkv, freqs.clone() + 0.25)  # another tensor
    check(qkv.bfloat16(), freqs)  # another dtype


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_forward_only_split_gives_k_and_v_as_two_planes_of_one_buffer(backend):
    """(A paged KV cache then stores both in one copy: see ``PagedKVCache.store``.)"""
    qkv, freqs = _inputs(4, 2, 8, 1.0, torch.float32)
    with fusion_backend(backend):
        _, k, v = split_qkv(qkv.detach(), 4, 2, 8, freqs)
    pair = planes_of_one_tensor(k, v)
    assert pair is not None and torch.equal(pair[0], k) and torch.equal(pair[1], v)
