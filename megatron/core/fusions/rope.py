"""The split of a fused QKV projection into query, key and value heads, with rotary position
embeddings (RoPE, "rotate half" layout) applied to queries and keys on the way.

``qkv [s, b, (heads + 2 * groups) * d]`` packs ``[Q | K | V]`` per token (TP-local heads);
``freqs [s, b, 1, rot]`` (or ``[s, 1, 1, rot]``) holds the rotation angles of the first ``rot``
channels of each head (the rest pass through). Backends:

- triton (:mod:`rope_triton`): one pass reads the packed row and writes the rotated q and k;
  the backward writes the packed gradient directly (no concatenation);
- torch: the plain formula, its backward also filling one packed buffer; values are exactly
  those of autograd through ``split`` / ``reshape`` / :func:`apply_rotary_pos_emb`. q, k and v
  are stored batch-major (see :func:`_batch_major_like`).

Without ``freqs`` q, k and v are views of ``qkv`` on every backend.
"""

from __future__ import annotations

import weakref

import torch

from megatron.core.fusions.backend import fused_backend, needs_autograd


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` [s, b, heads, d]; the rest pass.

    Channel ``i`` of the first half pairs with channel ``i + rot / 2`` ("rotate half"), or with
    ``interleaved`` (GPT-J's layout, Megatron's --rotary-interleaved) channel ``2i`` with ``2i + 1``,
    both pairs turned by the angle ``freqs[..., i]``."""
    rot_dim = freqs.shape[-1]
    rotated, passthrough = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    if interleaved:
        half = rot_dim // 2
        cos, sin = cos[..., :half], sin[..., :half]
        even, odd = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    else:
        rotated = rotated * cos + rotate_half(rotated) * sin
    return torch.cat((rotated, passthrough), dim=-1) if passthrough.numel() else rotated


def _split_views(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    s, b, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
    return q.reshape(s, b, heads, head_dim), k.reshape(s, b, groups, head_dim), v.reshape(s, b, groups, head_dim)


def split_qkv_reference(qkv, heads, groups, head_dim, freqs=None):
    """The plain ops: the oracle of the fused paths."""
    s, b, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
    q, k, v = q.reshape(s, b, heads, head_dim), k.reshape(s, b, groups, head_dim), v.reshape(s, b, groups, head_dim)
    if freqs is not None:
        q, k = apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs)
    return q, k, v


def _rotate_into(out, x, cos, sin, inverse: bool) -> None:
    """``out = x`` rotated by the angles (``inverse``: by minus the angles), written into ``out``.

    With ``h = rot / 2`` halves, the forward ``x * cos + rotate_half(x) * sin`` is
    ``[x1 cos1 - x2 sin1, x2 cos2 + x1 sin2]`` element for element, and the gradient autograd
    derives for it is ``[g1 cos1 + g2 sin2, g2 cos2 - g1 sin1]``: the same rounding, with one
    full-width product and two half-width updates in place of a concatenation.
    """
    rot = cos.shape[-1]
    half = rot // 2
    x1, x2 = x[..., :half], x[..., half:rot]
    torch.mul(x[..., :rot], cos, out=out[..., :rot])
    if inverse:
        out[..., :half].add_(x2 * sin[..., half:])
        out[..., half:rot].sub_(x1 * sin[..., :half])
    else:
        out[..., :half].sub_(x2 * sin[..., :half])
        out[..., half:rot].add_(x1 * sin[..., half:])
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]


def _batch_major_like(t: torch.Tensor) -> torch.Tensor:
    """An empty ``[s, b, n, d]`` tensor stored as ``[b, s, n, d]``: SDPA on CPU reads each
    sequence's rows contiguously then (the same results, faster)."""
    s, b, n, d = t.shape
    return t.new_empty(b, s, n, d).transpose(0, 1)


class _LastCosSin:
    """``cos`` and ``sin`` of the last angles asked for, kept while that tensor lives unchanged:
    every layer of a forward gets the same ``freqs``, so they are computed once per forward."""

    def __init__(self):
        self._key = None
        self._value = None

    def __call__(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._key
        if key is None or key[0]() is not freqs or key[1:] != (freqs._version, dtype):
            self._value = freqs.cos().to(dtype), freqs.sin().to(dtype)
            self._key = (weakref.ref(freqs), freqs._version, dtype)
        return self._value


_cos_sin = _LastCosSin()


def _split_rotate(qkv, freqs, heads, groups, head_dim):
    q, k, v = _split_views(qkv, heads, groups, head_dim)
    cos, sin = freqs.cos().to(qkv.dtype), freqs.sin().to(qkv.dtype)
    q_rot, k_rot, v_out = _batch_major_like(q), _batch_major_like(k), _batch_major_like(v)
    _rotate_into(q_rot, q, cos, sin, inverse=False)
    _rotate_into(k_rot, k, cos, sin, inverse=False)
    v_out.copy_(v)
    return q_rot, k_rot, v_out, cos, sin


def _split_rotate_packed(qkv, heads, groups, head_dim, cos, sin):
    """The forward-only split: q and k (adjacent in ``qkv``) rotated as one tensor of ``heads +
    groups`` heads, into one batch-major ``[Q | K | V]`` buffer of which q, k and v are views; k and
    v are then two planes of it (a paged KV cache stores both in one copy). The same elementwise
    ops as :func:`_split_rotate`, so the same values, in half the calls."""
    s, b, _ = qkv.shape
    rotated = heads + groups
    packed = qkv.new_empty(b, s, rotated + groups, head_dim).transpose(0, 1)
    _rotate_into(
        packed[:, :, :rotated], qkv[..., : rotated * head_dim].reshape(s, b, rotated, head_dim), cos, sin, False
    )
    packed[:, :, rotated:] = qkv[..., rotated * head_dim :].reshape(s, b, groups, head_dim)
    return packed[:, :, :heads], packed[:, :, heads:rotated], packed[:, :, rotated:]


class _SplitRotaryTorch(torch.autograd.Function):
    """Split and rotate in torch ops; the backward fills one packed gradient buffer."""

    @staticmethod
    def forward(ctx, qkv, freqs, heads, groups, head_dim):
        q_rot, k_rot, v, cos, sin = _split_rotate(qkv, freqs, heads, groups, head_dim)
        ctx.save_for_backward(cos, sin)
        ctx.sizes = heads, groups, head_dim
        return q_rot, k_rot, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        heads, groups, head_dim = ctx.sizes
        s, b = dq.shape[:2]
        dqkv = dq.new_empty(s, b, (heads + 2 * groups) * head_dim)
        gq, gk, gv = _split_views(dqkv, heads, groups, head_dim)
        _rotate_into(gq, dq, cos, sin, inverse=True)
        _rotate_into(gk, dk, cos, sin, inverse=True)
        gv.copy_(dv)
        return dqkv, None, None, None, None


def split_qkv(
    qkv: torch.Tensor, heads: int, groups: int, head_dim: int, freqs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [s, b, heads, d], k [s, b, groups, d], v [s, b, groups, d])`` of the packed ``qkv``;
    q and k rotated by ``freqs`` when given."""
    if freqs is None:
        return _split_views(qkv, heads, groups, head_dim)
    if torch.compiler.is_compiling():  # Inductor fuses the plain ops
        return split_qkv_reference(qkv, heads, groups, head_dim, freqs)
    if fused_backend("rope", qkv.device) == "torch":
        if not needs_autograd(qkv):
            return _split_rotate_packed(qkv, heads, groups, head_dim, *_cos_sin(freqs, qkv.dtype))
        return _SplitRotaryTorch.apply(qkv, freqs, heads, groups, head_dim)
    from megatron.core.fusions.rope_triton import SplitRotaryFunction, split_rotary_forward

    if needs_autograd(qkv):
        return SplitRotaryFunction.apply(qkv, freqs, heads, groups, head_dim)
    return split_rotary_forward(qkv, freqs, heads, groups, head_dim)
