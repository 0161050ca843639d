"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

All three shard their weight over ``tp`` and, when the ``gtp`` group has G > 1 peers, shard the
TP-local weight again on dim 0 over ``gtp`` (see :mod:`gtp`). Biases stay whole on every GTP
peer. Parameters are built by :func:`sharding.create_parallel_parameter`, which also tags them
with the sharding attributes that DDP, optimizers and checkpointing read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from megatron.core.distributed.main_grad import add_product_to_main_grad, fusable_main_grad, main_grad_placeholder
from megatron.core.fusions.backend import fused_backend
from megatron.core.inference.kernels import invariant_linear, is_batch_invariant
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.tensor_parallel import gtp as gtp_ops
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.sharding import create_parallel_parameter
from megatron.core.tensor_parallel.utils import (
    TensorParallelError,
    divide,
    pad_vocab_size,
    unpack_tp_gathered,
    vocab_range,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "pad_vocab_size"]


def _gtp_gather_args(weight: torch.Tensor, pg_collection, config) -> dict | None:
    """Arguments of the GTP gather of ``weight``; None when it is not GTP-sharded (plain TP)."""
    if not weight.gtp_sharded:
        return None
    scale = gtp_ops.grad_scale_for(config.calculate_per_token_loss, pg_collection.size("gtp"))
    return dict(group=pg_collection.gtp, rows=weight.gtp_rows, grad_scale=scale)


def widens(output_dtype: torch.dtype | None, input_dtype: torch.dtype) -> bool:
    """Whether a GEMM of ``input_dtype`` operands must compute in ``output_dtype`` (wider)."""
    return output_dtype is not None and torch.finfo(output_dtype).bits > torch.finfo(input_dtype).bits


class _LinearFunction(torch.autograd.Function):
    """``x @ W.T (+ b)`` with what ``F.linear`` cannot do (plain linears use it):

    - ``compute_dtype`` wider than the operands: the products and the sum are formed in it and
      the result is written in it, never rounded to the operands' dtype (on CUDA one GEMM with a
      wide output; elsewhere a GEMM of the operands cast up); the gradients are computed in it
      and returned in the operands' dtypes (no bias then);
    - ``accumulate_wgrad`` (gradient accumulation fusion): the weight-gradient GEMM adds ``d W``
      straight into ``weight.main_grad`` and the weight's gradient is DDP's placeholder
      (:mod:`megatron.core.distributed.main_grad`).

    The operands are saved in their own dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, compute_dtype, accumulate_wgrad):
        ctx.save_for_backward(x, weight)
        ctx.compute_dtype, ctx.accumulate_wgrad = compute_dtype, accumulate_wgrad
        if compute_dtype is None:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        if x.is_cuda and x.dtype == weight.dtype in (torch.float16, torch.bfloat16) and compute_dtype == torch.float32:
            out = torch.mm(rows, weight.t(), out_dtype=compute_dtype)  # cuBLAS: fp32 accumulation and output
        else:
            out = torch.mm(rows.to(compute_dtype), weight.to(compute_dtype).t())
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype or x.dtype
        grad = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad, weight.to(dtype)).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1]).to(dtype)
            if ctx.accumulate_wgrad:
                add_product_to_main_grad(weight.main_grad, grad.t(), rows)
                grad_w = main_grad_placeholder(weight)
            else:
                grad_w = torch.mm(grad.t(), rows).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_w, grad_bias, None, None


def _accumulates_wgrad(weight: torch.Tensor, config, operand_dtype: torch.dtype) -> bool:
    """Whether this GEMM's weight gradient goes straight into ``weight.main_grad``
    (``--no-gradient-accumulation-fusion`` turns it off): in a backward that is recorded, outside
    ``torch.compile`` (Inductor keeps the plain graph), where DDP keeps a ``main_grad`` one GEMM
    can accumulate into (see :func:`fusable_main_grad`); modules without DDP get plain gradients."""
    return (
        config.gradient_accumulation_fusion
        and weight.requires_grad
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and fusable_main_grad(weight, operand_dtype)
    )


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    pg_collection,
    config,
    output_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with W the TP-local weight (re-materialized from GTP shards when
    sharded), in ``output_dtype`` when given: computed in it when it is wider than the operands,
    cast to it otherwise; in the inference forward's batch-invariant mode, rows independent of the
    row count. ``bias`` only for a weight that is not GTP-sharded and no wider ``output_dtype``."""
    gtp_args = _gtp_gather_args(weight, pg_collection, config)
    compute_dtype = output_dtype if widens(output_dtype, x.dtype) else None
    if gtp_args is not None:
        return _cast(gtp_ops.linear_with_gtp_weight(x, weight, **gtp_args, compute_dtype=compute_dtype), output_dtype)
    accumulate_wgrad = not is_batch_invariant() and _accumulates_wgrad(weight, config, compute_dtype or x.dtype)
    if compute_dtype is not None or accumulate_wgrad:
        out = _LinearFunction.apply(x, weight, bias, compute_dtype, accumulate_wgrad)
    else:
        out = invariant_linear(x, weight, bias) if is_batch_invariant() else F.linear(x, weight, bias)
    return _cast(out, output_dtype)


def _cast(out: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return out if dtype is None else out.to(dtype)


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise TensorParallelError(f"{name} must be a positive integer, got {value!r}")


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with A split over TP on its output dim (dim 0): A is ``[output_size/tp, input_size]``.

    ``output_partition_sizes``: global sizes of packed parts of the output (Q,K,V; Mamba
    z,x,B,C,dt); each part is split over TP on its own, so each rank's output is the
    concatenation of its slice of every part. With ``config.sequence_parallel`` the input is
    ``[s/tp, b, h]`` and is all-gathered on dim 0. ``output_dtype`` (Megatron's): the dtype the
    GEMM writes, e.g. fp32 logits from bf16 weights and activations, accumulated in fp32 and
    never rounded to bf16 (None: the input's). ``forward(x) -> (output, output_bias)``, where
    ``output_bias`` is the (TP-local) bias when ``skip_bias_add`` and None otherwise.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable[[torch.Tensor], object],
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        output_partition_sizes: Sequence[int] | None = None,
        pg_collection=None,
        output_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        _check_sizes(input_size=input_size, output_size=output_size)
        self.config = config
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.output_dtype = output_dtype
        self.tp_group = self.pg_collection.tp  # read once: forward passes stay traceable by torch.compile
        tp = self.pg_collection.size("tp")
        if output_partition_sizes is not None:
            parts = list(output_partition_sizes)
            if sum(parts) != output_size or any(p < 1 for p in parts):
                raise TensorParallelError(
                    f"output_partition_sizes {parts} must be positive and sum to output_size ({output_size})"
                )
            for part in parts:
                divide(part, tp, f"part of output_partition_sizes {parts}")
        divide(output_size, tp, "ColumnParallelLinear output_size")
        if gather_output and config.sequence_parallel:
            raise TensorParallelError(
                "ColumnParallelLinear: gather_output=True is not supported with sequence_parallel"
            )
        self.input_size, self.output_size = input_size, output_size
        self.output_partition_sizes = list(output_partition_sizes) if output_partition_sizes else None
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = config.sequence_parallel
        self.weight = create_parallel_parameter(
            config,
            (output_size, input_size),
            init_method,
            self.pg_collection,
            partition_dim=0,
            partition_sizes=self.output_partition_sizes,
            gtp_shard=True,
        )
        self.bias = None
        if bias:
            self.bias = create_parallel_parameter(
                config,
                (output_size,),
                None,
                self.pg_collection,
                partition_dim=0,
                partition_sizes=self.output_partition_sizes,
            )

    def input_in_tp_region(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the GEMM reads it on every TP rank: all-gathered over the sequence under
        sequence parallelism, else the whole input (its gradient all-reduced over TP)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.tp_group)
        return copy_to_tensor_model_parallel_region(x, self.tp_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        tp_group = self.tp_group
        x = self.input_in_tp_region(x)
        add_bias = self.bias is not None and not self.skip_bias_add
        # The bias in the GEMM's epilogue (cuBLAS; the batch-invariant GEMM's in that mode)
        fuse_bias = (
            add_bias
            and self.output_dtype is None
            and not self.weight.gtp_sharded
            and fused_backend("linear_bias", x.device) == "triton"
        )
        bias = self.bias if fuse_bias else None
        out = _linear(x, self.weight, self.pg_collection, self.config, self.output_dtype, bias=bias)
        if add_bias and not fuse_bias:
            out = out + self.bias
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, tp_group)
            out = unpack_tp_gathered(out, out.dim() - 1, self.output_partition_sizes, self.pg_collection.size("tp"))
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with A split over TP on its input dim (dim 1): A is ``[output_size, input_size/tp]``.

    The partial products are all-reduced over TP, or reduce-scattered on dim 0 (sequence) under
    ``config.sequence_parallel``. The bias is whole on every rank and added after the reduction.
    ``forward(x) -> (output, output_bias)``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable[[torch.Tensor], object],
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        pg_collection=None,
    ):
        super().__init__()
        _check_sizes(input_size=input_size, output_size=output_size)
        self.config = config
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = self.pg_collection.tp  # read once: forward passes stay traceable by torch.compile
        divide(input_size, self.pg_collection.size("tp"), "RowParallelLinear input_size")
        if config.sequence_parallel and not input_is_parallel:
            raise TensorParallelError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = config.sequence_parallel
        self.weight = create_parallel_parameter(
            config, (output_size, input_size), init_method, self.pg_collection, partition_dim=1, gtp_shard=True
        )
        self.bias = None
        if bias:
            self.bias = create_parallel_parameter(
                config,
                (output_size,),
                None,
                self.pg_collection,
                partition_dim=-1,
                sequence_parallel=config.sequence_parallel,
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        tp_group = self.tp_group
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, tp_group)
        partial = _linear(x, self.weight, self.pg_collection, self.config)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, tp_group)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        return out, (self.bias if self.skip_bias_add else None)


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split over TP on the vocabulary: weight ``[V/tp, h]``.

    ``num_embeddings`` must already be padded to a multiple of tp (:func:`pad_vocab_size`).
    ``forward(ids [b, s]) -> [b, s, h]``: each rank looks up the ids in its range, zeros the
    others, and the results are all-reduced over TP.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config, init_method, pg_collection=None):
        super().__init__()
        _check_sizes(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.config = config
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.tp_group = self.pg_collection.tp  # read once: forward passes stay traceable by torch.compile
        tp = self.pg_collection.size("tp")
        if num_embeddings % tp:
            raise TensorParallelError(
                f"num_embeddings ({num_embeddings}) must be divisible by tensor_model_parallel_size ({tp}); "
                f"pad it with pad_vocab_size (e.g. {pad_vocab_size(num_embeddings, tp)})"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, self.pg_collection.rank("tp"), tp)
        self.weight = create_parallel_parameter(
            config, (num_embeddings, embedding_dim), init_method, self.pg_collection, partition_dim=0, gtp_shard=True
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.pg_collection.size("tp")
        ids = input_ids
        if tp > 1:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        weight = self.weight
        gtp_args = _gtp_gather_args(weight, self.pg_collection, self.config)
        if gtp_args is not None:
            weight = gtp_ops.gather_gtp_weight(weight, **gtp_args)
        out = F.embedding(ids, weight)
        if tp > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)
