"""The routed experts as grouped GEMMs over tokens sorted by expert.

``weight1`` is ``[num_local_experts, hidden, ffn]`` (``2 * ffn`` when gated: gate then up) and
``weight2`` is ``[num_local_experts, ffn, hidden]``; both carry ``is_expert = True``. Only this
rank's experts (global ids ``local_expert_offset ..``) are stored. With layout-invariant
initialization the weights of all experts are drawn and this rank keeps its own, so the same
seed gives the same experts under any expert-parallel size.

Expert tensor parallelism (ETP, ``etp_size`` ranks of ``expt_tp``) shards the ffn dimension:
``weight1`` is column-parallel (``[.., hidden, ffn / etp]``, gate and up each sharded so the
SwiGLU split stays local: this rank holds ``[gate_r; up_r]``), ``weight2`` row-parallel
(``[.., ffn / etp, hidden]``); the outputs are partial sums the token dispatcher reduces over
``expt_tp``. Both (and ``bias1``) then carry ``tensor_model_parallel`` / ``partition_dim`` / ``expert_gated``
for checkpoint resharding and grad-norm counting.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.fusions.activations import activation
from megatron.core.inference.kernels import invariant_linear, is_batch_invariant
from megatron.core.tensor_parallel import checkpoint
from megatron.core.transformer.init_methods import init_method, output_layer_init_method


def grouped_gemm_supported(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs on CUDA devices of compute capability 9.0+ in bf16."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def grouped_gemm(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``x [n, k]`` rows grouped by expert (``tokens_per_expert [E]`` rows each, in order) times
    ``weights [E, k, m]`` -> ``[n, m]``. One ``torch._grouped_mm`` where supported, else a loop
    over the experts (the reference). In the engine's batch-invariant mode each expert's rows go
    through the invariant linear, so a token's output does not depend on the tokens it shares an
    expert with."""
    if is_batch_invariant():
        chunks = torch.split(x, tokens_per_expert.tolist(), dim=0)
        return torch.cat(
            [invariant_linear(chunk, weight.t()) for chunk, weight in zip(chunks, weights, strict=True)], dim=0
        )
    if grouped_gemm_supported(x):
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weights, offs=offsets)
    return grouped_gemm_reference(x, weights, tokens_per_expert)


def grouped_gemm_reference(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Loop over the experts: one matmul per expert's contiguous rows."""
    chunks = torch.split(x, tokens_per_expert.tolist(), dim=0)
    return torch.cat([chunk @ weight for chunk, weight in zip(chunks, weights, strict=True)], dim=0)


class _ScaleForward(torch.autograd.Function):
    """``x * scale`` forward, identity backward: a replicated bias added to each of ``1 / scale``
    partial sums enters their sum once and keeps its full gradient."""

    @staticmethod
    def forward(ctx, x, scale):
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ffn_shard(full: torch.Tensor, dim: int, etp_rank: int, etp_size: int, gated: bool) -> torch.Tensor:
    """This ETP rank's slice of ``full`` along the ffn dimension ``dim``; a gated (``[gate; up]``)
    dimension gives ``[gate_r; up_r]``."""
    if etp_size == 1:
        return full
    parts = full.chunk(2, dim) if gated else (full,)
    return torch.cat([part.chunk(etp_size, dim)[etp_rank] for part in parts], dim)


def _expert_weight(config, shape, init, offset: int, count: int, shard=None) -> nn.Parameter:
    """Experts ``offset .. offset + count`` of a ``shape`` tensor holding every expert; ``shard``
    ``(dim, etp_rank, etp_size, gated)`` keeps this rank's ffn slice, marked tensor-parallel when
    ``etp_size > 1`` (at ETP 1 the experts are plain replicas of ``expt_tp``)."""
    full = torch.zeros(shape, dtype=torch.float32)
    if init is not None and config.perform_initialization:
        for expert in full:  # each expert drawn as one dense matrix of its shape
            init(expert)
    local = full[offset : offset + count]
    sharded = shard is not None and shard[2] > 1
    if sharded:
        dim, etp_rank, etp_size, gated = shard
        local = ffn_shard(local, dim, etp_rank, etp_size, gated)
    param = nn.Parameter(local.to(config.params_dtype).contiguous())
    param.is_expert = True
    if sharded:
        param.tensor_model_parallel, param.partition_dim, param.expert_gated = True, dim, gated
    return param


class GroupedMLP(nn.Module):
    """``forward(tokens [n, h] sorted by local expert, tokens_per_expert [num_local_experts])
    -> [n, h]``: ``act(x @ weight1 + bias1) @ weight2 + bias2`` per expert; with ``etp_size > 1``
    this rank's partial sum over its ffn shard (``bias2 / etp_size`` each, so the sum over
    ``expt_tp`` holds it once)."""

    def __init__(
        self,
        config: TransformerConfig,
        num_local_experts: int,
        local_expert_offset: int = 0,
        etp_rank: int = 0,
        etp_size: int = 1,
    ):
        super().__init__()
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_offset = local_expert_offset
        self.etp_size = etp_size
        self.gated = config.gated_linear_unit
        num_experts, hidden = config.num_moe_experts, config.hidden_size
        ffn = config.moe_ffn_hidden_size
        if ffn % etp_size:
            raise ConfigError(
                f"moe_ffn_hidden_size ({ffn}) must be divisible by the expert-tensor-parallel size ({etp_size})"
            )
        fc1_out = 2 * ffn if self.gated else ffn
        offset, count = local_expert_offset, num_local_experts
        self.weight1 = _expert_weight(
            config,
            (num_experts, hidden, fc1_out),
            init_method(config),
            offset,
            count,
            (2, etp_rank, etp_size, self.gated),
        )
        self.weight2 = _expert_weight(
            config,
            (num_experts, ffn, hidden),
            output_layer_init_method(config),
            offset,
            count,
            (1, etp_rank, etp_size, False),
        )
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            self.bias1 = _expert_weight(
                config, (num_experts, fc1_out), None, offset, count, (1, etp_rank, etp_size, self.gated)
            )
            self.bias2 = _expert_weight(config, (num_experts, hidden), None, offset, count)

    def _activation_and_fc2(self, intermediate: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        activated = activation(intermediate, None, self.config.activation_func, self.gated)
        return grouped_gemm(activated, self.weight2, tokens_per_expert)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        intermediate = grouped_gemm(tokens, self.weight1, tokens_per_expert)
        if self.bias1 is not None:
            intermediate = intermediate + self.bias1.repeat_interleave(tokens_per_expert, dim=0)
        if self.training and self.config.recomputes("moe_act"):  # keeps the activation's input, not its output
            out = checkpoint(self._activation_and_fc2, intermediate, tokens_per_expert)
        else:
            out = self._activation_and_fc2(intermediate, tokens_per_expert)
        if self.bias2 is not None:
            bias2 = self.bias2 if self.etp_size == 1 else _ScaleForward.apply(self.bias2, 1.0 / self.etp_size)
            out = out + bias2.repeat_interleave(tokens_per_expert, dim=0)
        return out
