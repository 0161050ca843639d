"""Self-attention (MHA/GQA, causal) with a fused QKV column-parallel projection, optional RoPE,
torch SDPA core attention and a row-parallel output projection.

Under TP each rank owns ``heads/tp`` query heads and ``groups/tp`` key/value groups. The QKV
weight is packed as [Q; K; V] (``output_partition_sizes``), so each rank's slice is the
concatenation of its Q, K and V rows.

With ``config.qk_layernorm`` queries and keys are normalized per head (one ``head_dim`` norm
each, before RoPE; Qwen3's q_norm / k_norm). Under TP every rank normalizes other heads, so the
norm weights' gradients are partial and are summed over ``tp`` (``sequence_parallel`` tag).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.fusions.dropout import sharded_rng_context
from megatron.core.fusions.rope import apply_rotary_pos_emb, split_qkv
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.context_parallel import ContextParallelConfigError, cp_size_of
from megatron.core.transformer.context_parallel.block_attention import get_block_attention
from megatron.core.transformer.context_parallel.ring_attention import context_parallel_attention
from megatron.core.transformer.init_methods import init_method, output_layer_init_method
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rope import yarn_concentration
from megatron.core.transformer.spec import build_module

ATTN_MASK_TYPES = ("causal", "no_mask")

# --attention-backend -> the SDPA kernels allowed, in priority order (SDPA takes the first that
# supports the inputs). Megatron's names: "flash" the flash-attention kernel, "fused" cuDNN's
# fused attention (Transformer Engine's choice on Hopper), "unfused" / "local" the plain math.
# "auto" on CUDA tries cuDNN first: on Hopper its causal bf16 forward and backward beat the
# flash kernel at training shapes (benchmarks/gpu_train.py's SDPA probe measures each).
_SDPA_BACKENDS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
}
_AUTO_CUDA = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(name: str, device: torch.device) -> list[SDPBackend] | None:
    """The SDPA kernels ``--attention-backend name`` allows on ``device``, in priority order;
    None where SDPA's own choice stands: "auto" off CUDA, and "fused" off CUDA (cuDNN runs on
    CUDA only, so a GPU script still runs on a CPU)."""
    if device.type != "cuda" and name in ("auto", "fused"):
        return None
    return _AUTO_CUDA if name == "auto" else _SDPA_BACKENDS[name]


def _allowed_kernels(backends: list[SDPBackend] | None):
    """A context in which SDPA picks among ``backends`` in their order (None: SDPA's default).
    Dynamo traces it, so compiled layers (``--use-torch-compile``) run the kernel it picks too."""
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends, set_priority=True)


@runtime_checkable
class AttentionInferenceContext(Protocol):
    """What attention needs from an inference context (e.g. the dynamic, paged KV cache).

    ``store_kv_and_attend`` receives this step's rotated ``q`` [s, b, heads/tp, d] and
    ``k``, ``v`` [s, b, groups/tp, d] of global layer ``layer_number``, stores K/V in its cache
    and returns the attention context [s, b, heads/tp, d] over every cached token.
    """

    def store_kv_and_attend(
        self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class DotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over [s, b, heads, d] inputs with torch SDPA; GQA by sharing
    each key/value group among ``heads / groups`` consecutive query heads (SDPA's
    ``enable_gqa``: the kernels read the shared heads, nothing is repeated in memory), among the
    kernels ``config.attention_backend`` allows (:func:`sdpa_backends`).

    Under context parallelism (a ``cp`` group of size > 1 in ``pg_collection``) the inputs hold
    this CP rank's load-balanced chunks of the sequence and attention runs over the whole
    sequence with ``config.cp_comm_type`` (:mod:`context_parallel.ring_attention`); it must
    be causal, without an explicit mask or attention dropout.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: str = "causal",
        softmax_scale: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else default_softmax_scale(config)
        self.cp_group = None
        if pg_collection is not None and cp_size_of(pg_collection) > 1:
            if attn_mask_type != "causal":
                raise ContextParallelConfigError(
                    f"context parallelism needs causal attention, got attn_mask_type={attn_mask_type!r}"
                )
            self.cp_group = pg_collection.cp

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Context [s, b, heads * d]. ``attention_mask`` (bool, True = masked out, broadcastable
        to [b, heads, s_q, s_k]) replaces the causal mask when given."""
        s, b, heads, d = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        if self.cp_group is not None:
            return self._context_parallel(q, k, v, attention_mask).permute(2, 0, 1, 3).reshape(s, b, heads * d)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        mask = None if attention_mask is None else ~attention_mask
        causal = attention_mask is None and self.attn_mask_type == "causal"
        backends = sdpa_backends(self.config.attention_backend, q.device)
        # Heads are TP-sharded: each rank draws its own dropout mask.
        with sharded_rng_context(dropout_p > 0.0), _allowed_kernels(backends):
            ctx = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self.softmax_scale,
                # From the config, a plain bool (from the shapes it is a symbol when compiled with dynamic shapes).
                enable_gqa=self.config.num_query_groups != self.config.num_attention_heads,
            )
        return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * v.shape[-1])  # MLA: values are narrower

    def _context_parallel(self, q, k, v, attention_mask):
        if attention_mask is not None:
            raise ContextParallelConfigError(
                "context parallelism takes no explicit attention_mask (causal attention over the sharded sequence)"
            )
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        dropout_p = self.config.attention_dropout if self.training else 0.0
        kernel = get_block_attention(q.device, q.dtype, dropout=dropout_p > 0.0)
        with sharded_rng_context(dropout_p > 0.0):  # CP ranks hold other rows: their masks are their own
            return context_parallel_attention(
                q, k, v, self.cp_group, self.config.cp_comm_type, scale, kernel, dropout_p
            )


def default_softmax_scale(config: TransformerConfig) -> float | None:
    """The attention scale a config implies: None (SDPA's ``1 / sqrt(head_dim)``) unless YaRN
    RoPE scales rotated queries and keys by its concentration factor, which multiplies every
    logit by its square (the whole head is rotated under YaRN). Multi-latent attention scales
    its rotated channels itself and takes :func:`megatron.core.transformer.mla.mla_softmax_scale`."""
    if config.multi_latent_attention:
        from megatron.core.transformer.mla import mla_softmax_scale

        return mla_softmax_scale(config)
    concentration = yarn_concentration(config)
    return None if concentration == 1.0 else config.kv_channels**-0.5 * concentration**2


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Any = ColumnParallelLinear
    core_attention: Any = DotProductAttention
    linear_proj: Any = RowParallelLinear


class SelfAttention(nn.Module):
    """Causal (or unmasked) self-attention. ``forward(hidden [s, b, h], attention_mask=None,
    rotary_pos_emb=None, inference_context=None) -> (out [s, b, h], bias or None)``; the
    output bias is returned unadded for the layer's bias-dropout-add."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        pg_collection: ProcessGroupCollection | None = None,
        attn_mask_type: str = "causal",
    ):
        super().__init__()
        pg_collection = resolve_pg_collection(pg_collection)
        if attn_mask_type not in ATTN_MASK_TYPES:
            raise ConfigError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")
        tp = pg_collection.size("tp")
        self.config = config
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        self.heads_per_rank = divide(config.num_attention_heads, tp, "num_attention_heads over tp")
        self.groups_per_rank = divide(config.num_query_groups, tp, "num_query_groups over tp")
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_query_groups * self.head_dim
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            q_size + 2 * kv_size,
            config=config,
            init_method=init_method(config),
            bias=config.add_bias_linear or config.add_qkv_bias,
            gather_output=False,
            output_partition_sizes=[q_size, kv_size, kv_size],
            pg_collection=pg_collection,
        )
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = build_norm(config, self.head_dim), build_norm(config, self.head_dim)
            for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                param.sequence_parallel = param.sequence_parallel or tp > 1
        self.core_attention = build_module(
            submodules.core_attention, config, layer_number, attn_mask_type, pg_collection=pg_collection
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            q_size,
            config.hidden_size,
            config=config,
            init_method=output_layer_init_method(config),
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            pg_collection=pg_collection,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        inference_context: AttentionInferenceContext | None = None,
    ):
        qkv, _ = self.linear_qkv(hidden_states)
        s, b, _ = qkv.shape
        interleaved = self.config.rotary_interleaved
        # RoPE is fused into the split unless the query/key norms come first or it is interleaved
        fused_rope = self.q_layernorm is None and not interleaved
        q, k, v = split_qkv(
            qkv, self.heads_per_rank, self.groups_per_rank, self.head_dim, rotary_pos_emb if fused_rope else None
        )
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q.contiguous()), self.k_layernorm(k.contiguous())
        if rotary_pos_emb is not None and not fused_rope:
            q = apply_rotary_pos_emb(q, rotary_pos_emb, interleaved)
            k = apply_rotary_pos_emb(k, rotary_pos_emb, interleaved)
        if inference_context is not None:
            context = inference_context.store_kv_and_attend(self.layer_number, q, k, v).reshape(s, b, -1)
        elif self.config.recomputes("core_attn") and self.training:
            context = checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            context = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(context)
