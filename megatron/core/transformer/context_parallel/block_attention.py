"""Attention of one query block against one key/value block, returning the log-sum-exp, and
its backward from the merged output and log-sum-exp: the local computation of ring attention.

Layouts are SDPA's: ``q [b, heads, sq, d]``, ``k``/``v`` [b, groups, sk, d] (GQA: each key/value
group serves ``heads / groups`` consecutive query heads), ``lse [b, heads, sq]`` (fp32, natural
log of the softmax denominator of the scaled scores). ``causal`` blocks are square and masked
top-left (query i sees keys 0..i).

The backward of a block takes the *final* output and log-sum-exp of its query rows (merged over
every block of the ring), so ``exp(scores - lse)`` is the true attention probability and the
per-block gradients add up exactly (the flash-attention backward), and the opaque ``aux`` its
forward returned (what the fused kernel's backward needs of its forward: sequence metadata,
RNG state; None for the torch kernel).

Two kernels behind :func:`get_block_attention`:

- ``torch``: matmuls in fp32 (any device; the CPU path and the oracle);
- ``sdpa``: aten's fused flash-attention kernels that return the log-sum-exp (the CPU flash
  kernel, or CUDA flash attention for bf16/fp16), key/value groups expanded for GQA.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from megatron.core.transformer.context_parallel.sharding import ContextParallelConfigError

BLOCK_ATTENTION_BACKENDS = ("auto", "torch", "sdpa")


class BlockAttention(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        dropout: tuple[float, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(out [b, heads, sq, d] in q's dtype, lse [b, heads, sq] fp32 (fp64 for fp64 inputs), aux);
        ``dropout`` ``(p, seed)``: drop attention probabilities with a mask drawn from ``seed`` (the
        log-sum-exp stays that of the undropped scores)."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of this block, shaped like q, k, v."""
        ...


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, heads, s, d]`` as ``[b, groups, heads/groups, s, d]`` (a view: heads of a group are consecutive)."""
    b, heads, s, d = q.shape
    return q.view(b, groups, heads // groups, s, d)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


class TorchBlockAttention:
    """Block attention in plain torch, fp32 math (fp64 for fp64 inputs)."""

    name = "torch"

    @staticmethod
    def _probabilities(q, k, causal, scale, lse=None):
        groups, acc = k.shape[1], _acc_dtype(q)
        scores = torch.matmul(_grouped(q.to(acc), groups), k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        else:
            lse = _grouped(lse.to(acc).unsqueeze(-1), groups).squeeze(-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse  # [b, g, r, sq, sk], [b, g, r, sq]

    @staticmethod
    def _kept(probs: torch.Tensor, dropout: tuple[float, int]) -> torch.Tensor:
        """The dropout mask of ``dropout = (p, seed)``, scaled by ``1 / (1 - p)``."""
        p, seed = dropout
        generator = torch.Generator(device=probs.device).manual_seed(seed)
        keep = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype) >= p
        return keep.to(probs.dtype) / (1 - p)

    def forward(self, q, k, v, causal, scale, dropout=None):
        probs, lse = self._probabilities(q, k, causal, scale)
        dropped = probs if dropout is None else probs * self._kept(probs, dropout)
        out = torch.matmul(dropped, v.to(probs.dtype).unsqueeze(2))  # [b, g, r, sq, d]
        return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2), dropout

    def backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        """The flash-attention backward; with dropout (``aux``) the mask is drawn again and
        the softmax's row term stays ``rowsum(dout * out)`` of the dropped output."""
        groups, acc = k.shape[1], _acc_dtype(q)
        probs, _ = self._probabilities(q, k, causal, scale, lse)
        kept = None if aux is None else self._kept(probs, aux)
        dout_g = _grouped(dout.to(acc), groups)
        dv = torch.matmul((probs if kept is None else probs * kept).transpose(-1, -2), dout_g).sum(2)
        dprobs = torch.matmul(dout_g, v.to(acc).unsqueeze(2).transpose(-1, -2))
        if kept is not None:
            dprobs = dprobs * kept
        delta = (dout_g * _grouped(out.to(acc), groups)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, k.to(acc).unsqueeze(2)).flatten(1, 2)
        dk = torch.matmul(dscores.transpose(-1, -2), _grouped(q.to(acc), groups)).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def _reduce_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    b, heads, s, d = grad.shape
    return grad if groups == heads else grad.view(b, groups, heads // groups, s, d).sum(2)


class SdpaBlockAttention:
    """aten's fused flash-attention forward/backward (CPU flash kernel, or CUDA flash for bf16/fp16)."""

    name = "sdpa"

    def forward(self, q, k, v, causal, scale, dropout=None):
        if dropout is not None:
            raise ContextParallelConfigError("the fused block kernel takes no dropout; ring attention uses torch's")
        heads = q.shape[1]
        k, v = _expand_groups(k, heads), _expand_groups(v, heads)
        if q.is_cuda:
            out, lse, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, _ = (
                torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            )
            return out, lse.float(), (cum_seq_q, cum_seq_k, max_q, max_k, seed, offset)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(_acc_dtype(q)), None

    def backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        heads, groups = q.shape[1], k.shape[1]
        k_x, v_x = _expand_groups(k, heads), _expand_groups(v, heads)
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        if q.is_cuda:
            cum_seq_q, cum_seq_k, max_q, max_k, seed, offset = aux
            q, k_x, v_x, lse = (t.contiguous() for t in (q, k_x, v_x, lse.float()))
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k_x, v_x, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
            )
        else:
            lse = lse.to(q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k_x, v_x, out, lse, 0.0, causal, scale=scale
            )
        return dq, _reduce_groups(dk, groups), _reduce_groups(dv, groups)


def get_block_attention(
    device: torch.device, dtype: torch.dtype, name: str = "auto", dropout: bool = False
) -> BlockAttention:
    """The block kernel for tensors of ``device`` and ``dtype``: ``"auto"`` picks the fused SDPA
    kernels on CUDA for bf16/fp16 and torch elsewhere (fp32 oracle precision on CPU); with
    attention ``dropout``, torch's (the one that draws its masks again in backward)."""
    if dropout:
        return TorchBlockAttention()
    if name not in BLOCK_ATTENTION_BACKENDS:
        raise ContextParallelConfigError(
            f"unknown block attention backend {name!r}; accepted: {', '.join(BLOCK_ATTENTION_BACKENDS)}"
        )
    if name == "sdpa" or (name == "auto" and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)):
        return SdpaBlockAttention()
    return TorchBlockAttention()
