"""The output layer and its cross-entropy in one op: ``loss = CE(hidden @ W^T, target)`` over a
TP-split vocabulary, without ever holding the ``[tokens, V/tp]`` logits of the whole batch.

The tokens are cut into chunks. For each chunk the forward computes the logits (one GEMM, in
``logit_dtype`` when given: fp32 logits of bf16 operands are a GEMM with an fp32 output), masks
the vocabulary padding, finds each token's log-sum-exp and target logit (the max / sum-exp /
target-logit reductions over the TP group of the vocab-parallel cross-entropy), overwrites the
logits with their gradient ``w[t] * (softmax - onehot)`` (the Triton kernels of
:mod:`cross_entropy_triton`, or torch ops on the torch backend) and turns it at once into this
chunk's rows of ``d hidden`` and its term of ``d W`` (two GEMMs in ``logit_dtype``, ``d W``
accumulated over the chunks in place by the GEMM). Backward only scales the two saved
gradients (in place: a graph through this op is backpropagated once).

That is exact when the gradient reaching the per-token loss is ``c * token_weight`` for one
scalar ``c``: the loss is reduced as ``c * sum(loss * token_weight)``, which is what the
training loss does with the loss mask as ``token_weight`` (its mean over the unmasked tokens,
or their sum with ``--calculate-per-token-loss``, times the loss scale). ``c`` is recovered on
the device as ``<grad, w> / <w, w>`` (no host synchronization). Any other use of the returned
loss (a per-token weighting not passed as ``token_weight``) needs the unfused path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.fusions.backend import fused_backend
from megatron.core.tensor_parallel.layers import widens
from megatron.core.tensor_parallel.utils import TensorParallelError

# Logit elements per chunk (bf16: 512 MiB): a few chunks for a training micro-batch, each GEMM
# still large enough to run at full speed.
CHUNK_LOGIT_ELEMENTS = 1 << 28


def chunk_rows(n_rows: int, local_vocab: int, chunk_logit_elements: int = CHUNK_LOGIT_ELEMENTS) -> int:
    """Tokens per chunk: as many as fit ``chunk_logit_elements`` logits, a multiple of 128 (GEMM
    tiles), at least 1 and at most ``n_rows``."""
    rows = max(1, chunk_logit_elements // local_vocab)
    if rows >= 128:
        rows -= rows % 128
    return min(rows, n_rows)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``out_dtype``: computed in it (the wider one) and written in it."""
    if a.dtype == b.dtype == out_dtype:
        return torch.mm(a, b)
    if a.is_cuda and a.dtype == b.dtype and widens(out_dtype, a.dtype):
        return torch.mm(a, b, out_dtype=out_dtype)  # cuBLAS: accumulation and output in out_dtype
    compute = out_dtype if widens(out_dtype, a.dtype) else a.dtype
    return torch.mm(a.to(compute), b.to(compute)).to(out_dtype)


def _stats_and_grad_torch(logits, local_target, row_weight, tp_group, upcast: bool):
    """Torch ops of one chunk: the per-token loss (fp32) and ``logits`` overwritten with
    ``row_weight * (softmax - onehot)``."""
    x = logits.float() if upcast else logits
    row_max = x.max(dim=-1).values
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    inside = local_target >= 0
    exp = (x - row_max.unsqueeze(-1)).exp()
    sum_exp = exp.sum(dim=-1)
    target_logit = x.gather(-1, local_target.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        both = torch.stack([sum_exp, target_logit])
        dist.all_reduce(both, group=tp_group)
        sum_exp, target_logit = both[0], both[1]
    loss = (sum_exp.log() + row_max - target_logit).float()
    grad = exp.div_(sum_exp.unsqueeze(-1))
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, local_target.clamp(min=0)] -= inside.to(grad.dtype)
    logits.copy_(grad.mul_(row_weight.to(grad.dtype).unsqueeze(-1)))
    return loss


def _stats_and_grad_triton(logits, local_target, row_weight, tp_group):
    from megatron.core.fusions.cross_entropy_triton import log_sum_exp_and_target, softmax_grad_in_place

    lse, target_logit = log_sum_exp_and_target(logits, local_target, tp_group)
    softmax_grad_in_place(logits, local_target, lse, row_weight)
    return lse - target_logit


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``CE(hidden @ W^T, target)`` per token, gradients formed in the forward; see the module."""

    @staticmethod
    def forward(ctx, hidden, weight, local_target, token_weight, tp_group, vocab_end, logit_dtype, upcast, chunk):
        n_rows, local_vocab = hidden.shape[0], weight.shape[0]
        dtype = logit_dtype or hidden.dtype  # of the logits and of the gradients' GEMMs
        triton = fused_backend("cross_entropy", hidden.device) == "triton"
        loss = torch.empty(n_rows, device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty(n_rows, hidden.shape[1], device=hidden.device, dtype=dtype)
        grad_weight = torch.empty(local_vocab, hidden.shape[1], device=hidden.device, dtype=dtype)
        row_weight = token_weight.float()
        weight_t, weight_in_dtype = weight.t(), weight.to(dtype)
        for start in range(0, n_rows, chunk):
            rows = slice(start, min(start + chunk, n_rows))
            logits = _mm(hidden[rows], weight_t, dtype)
            if vocab_end < local_vocab:  # this rank's padded ids: never in the softmax
                logits[:, vocab_end:] = torch.finfo(logits.dtype).min
            if triton:
                loss[rows] = _stats_and_grad_triton(logits, local_target[rows], row_weight[rows], tp_group)
            else:
                loss[rows] = _stats_and_grad_torch(logits, local_target[rows], row_weight[rows], tp_group, upcast)
            torch.mm(logits, weight_in_dtype, out=grad_hidden[rows])
            hidden_in_dtype = hidden[rows].to(dtype)
            # d W summed over the chunks by the GEMM itself (cuBLAS: fp32 accumulation, C read
            # back and rounded once per chunk), no temporary of [V/tp, h] per chunk.
            if start == 0:
                torch.mm(logits.t(), hidden_in_dtype, out=grad_weight)
            else:
                grad_weight.addmm_(logits.t(), hidden_in_dtype)
        ctx.save_for_backward(grad_hidden, grad_weight, row_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, row_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = (grad_loss.float() * row_weight).sum() / (row_weight * row_weight).sum().clamp(min=1e-30)
        # The saved gradients are this function's own buffers: scaled in place, no copies.
        return grad_hidden.mul_(scale).to(hidden_dtype), grad_weight.mul_(scale).to(weight_dtype), *(None,) * 7


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group,
    *,
    vocab_size: int | None = None,
    token_weight: torch.Tensor | None = None,
    logit_dtype: torch.dtype | None = None,
    upcast: bool = True,
    chunk_logit_elements: int = CHUNK_LOGIT_ELEMENTS,
) -> torch.Tensor:
    """Per-token loss ``-log softmax(hidden @ W^T)[target]`` (fp32, identical on every TP rank)
    computed chunk by chunk, with its gradients formed in the forward.

    Args:
        hidden: ``[..., h]``, the output layer's input as every TP rank sees it (after the
            sequence-parallel gather / the copy into the TP region).
        weight: ``[V_padded/tp, h]``, this rank's rows of the output layer (ids
            ``[r*V_padded/tp, (r+1)*V_padded/tp)``).
        target: ``[...]`` global token ids.
        tp_group: the group the vocabulary is split over.
        vocab_size: the true vocabulary size; ids from it up to ``V_padded`` are padding and never
            get probability (None: no padding).
        token_weight: ``[...]``, the weights the loss is summed with (the loss mask); the gradient
            reaching the loss must be a scalar multiple of it (None: of all ones). See the module.
        logit_dtype: the dtype the logit GEMM writes and the gradients are computed in (None:
            the operands').
        upcast: the torch backend computes the softmax in fp32 (else in the logits' dtype); the
            Triton kernels always do.
    """
    if hidden.shape[:-1] != target.shape or hidden.shape[-1] != weight.shape[-1]:
        raise TensorParallelError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target {tuple(target.shape)} must be "
            "[..., h], [V/tp, h] and [...]"
        )
    if token_weight is not None and token_weight.shape != target.shape:
        raise TensorParallelError(
            f"token_weight shape {tuple(token_weight.shape)} must be the target shape {tuple(target.shape)}"
        )
    local_vocab = weight.shape[0]
    start = dist.get_rank(tp_group) * local_vocab if tp_group is not None else 0
    vocab_end = local_vocab if vocab_size is None else min(max(vocab_size - start, 0), local_vocab)
    local_target = target.reshape(-1) - start
    local_target = local_target.masked_fill((local_target < 0) | (local_target >= local_vocab), -1)
    if token_weight is None:
        token_weight = torch.ones(target.shape, device=hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    loss = LinearCrossEntropyFunction.apply(
        rows,
        weight,
        local_target,
        token_weight.reshape(-1),
        tp_group,
        vocab_end,
        logit_dtype,
        upcast,
        chunk_rows(rows.shape[0], local_vocab, chunk_logit_elements),
    )
    return loss.view(target.shape)
