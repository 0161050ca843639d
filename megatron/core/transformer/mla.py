"""Multi-latent attention (DeepSeek-V2/V3's MLA, Megatron's ``--multi-latent-attention``).

Queries come from the hidden states directly (``linear_q_proj``) or through a low-rank latent
(``linear_q_down_proj`` -> ``q_layernorm`` -> ``linear_q_up_proj`` when ``q_lora_rank`` is set);
keys and values from one latent (``linear_kv_down_proj`` -> ``kv_layernorm`` ->
``linear_kv_up_proj``), whose down-projection also yields one rotated key shared by all heads.
Each head's query and key are ``qk_head_dim`` unrotated channels then ``qk_pos_emb_head_dim``
rotated ones (RoPE, or YaRN whose concentration factor multiplies the rotated channels only);
its value has ``v_head_dim`` channels. The softmax scale is ``1 / sqrt(qk_head_dim +
qk_pos_emb_head_dim)``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared.

Where keys and values must have one head size (:func:`mla_padded_head_dim`) — the inference
engine's paged cache, which stores them after the up-projection, and context parallelism, whose
ring exchanges keys and values together — the narrower of them, and the queries with the keys,
are zero-padded to it. Zero channels add exactly nothing to a score, and the values' padding is
cut from the result.

Tensor parallelism splits the heads (up-projections column-parallel, output row-parallel); the
down-projections and their norms are whole on every TP rank. Their gradients are complete
already (the up-projections all-reduce their inputs' gradients, the shared rotated key is copied
into the TP region), except under sequence parallelism, where each rank projects its part of
the sequence: then they are tagged ``sequence_parallel`` and summed over TP like the norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.fusions.rope import apply_rotary_pos_emb
from megatron.core.inference.kernels import invariant_linear, is_batch_invariant
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.sharding import create_parallel_parameter
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.context_parallel.sharding import cp_size_of
from megatron.core.transformer.init_methods import init_method, output_layer_init_method
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rope import yarn_concentration, yarn_mscale
from megatron.core.transformer.spec import build_module


def mla_softmax_scale(config: TransformerConfig) -> float:
    """``1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, times ``mscale(factor, mscale_all_dim)``
    squared under YaRN (Megatron's and HF DeepSeek's)."""
    scale = (config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
    factor = config.yarn_rotary_scaling_factor
    return scale if factor is None else scale * yarn_mscale(factor, config.yarn_mscale_all_dim) ** 2


def mla_padded_head_dim(config: TransformerConfig) -> int:
    """The one head size of keys and values where they must share one (see the module doc): the
    wider of a key (``qk_head_dim + qk_pos_emb_head_dim``) and a value (``v_head_dim``)."""
    return max(config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim)


class DuplicatedLinear(nn.Module):
    """A linear layer whole on every TP rank (Megatron's ``duplicated`` mode), no bias; its weight
    is tagged ``sequence_parallel`` (summed over TP after backward) when ``sum_over_tp``."""

    def __init__(self, input_size: int, output_size: int, *, config, pg_collection, sum_over_tp: bool):
        super().__init__()
        self.weight = create_parallel_parameter(
            config,
            (output_size, input_size),
            init_method(config),
            pg_collection,
            partition_dim=-1,
            sequence_parallel=sum_over_tp,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the inference forward's batch-invariant mode: rows independent of the row count
        return invariant_linear(x, self.weight) if is_batch_invariant() else F.linear(x, self.weight)


@dataclass
class MLASelfAttentionSubmodules:
    core_attention: Any = None


class MLASelfAttention(nn.Module):
    """``forward(hidden [s, b, h], attention_mask=None, rotary_pos_emb=None) -> (out, bias)`` like
    :class:`~megatron.core.transformer.attention.SelfAttention`; ``rotary_pos_emb`` holds the
    angles of the ``qk_pos_emb_head_dim`` rotated channels."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        pg_collection=None,
        attn_mask_type: str = "causal",
    ):
        super().__init__()
        pg_collection = resolve_pg_collection(pg_collection)
        tp = pg_collection.size("tp")
        self.pad_heads = cp_size_of(pg_collection) > 1  # the ring sends keys and values together
        self.config, self.layer_number = config, layer_number
        self.heads_per_rank = divide(config.num_attention_heads, tp, "num_attention_heads over tp")
        self.sequence_parallel, self.tp_group = config.sequence_parallel, pg_collection.tp
        heads, qk, pe, v = config.num_attention_heads, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.qk, self.pe, self.v = qk, pe, v
        self.concentration = yarn_concentration(config)  # of the rotated channels (1 without YaRN)
        sum_over_tp = config.sequence_parallel and tp > 1
        column = dict(config=config, init_method=init_method(config), bias=False, pg_collection=pg_collection)
        duplicated = dict(config=config, pg_collection=pg_collection, sum_over_tp=sum_over_tp)
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(config.hidden_size, heads * (qk + pe), **column)
        else:
            self.linear_q_down_proj = DuplicatedLinear(config.hidden_size, config.q_lora_rank, **duplicated)
            self.q_layernorm = build_norm(config, config.q_lora_rank)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, heads * (qk + pe), **column)
        self.linear_kv_down_proj = DuplicatedLinear(config.hidden_size, config.kv_lora_rank + pe, **duplicated)
        self.kv_layernorm = build_norm(config, config.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(config.kv_lora_rank, heads * (qk + v), **column)
        for norm in (getattr(self, "q_layernorm", None), self.kv_layernorm):
            for param in norm.parameters() if norm is not None else ():
                param.sequence_parallel = sum_over_tp
        # its softmax scale is the config's (default_softmax_scale: mla_softmax_scale under MLA)
        self.core_attention = build_module(
            submodules.core_attention, config, layer_number, attn_mask_type, pg_collection=pg_collection
        )
        self.linear_proj = RowParallelLinear(
            heads * v,
            config.hidden_size,
            config=config,
            init_method=output_layer_init_method(config),
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            pg_collection=pg_collection,
        )

    def _rotate(self, t: torch.Tensor, rotary_pos_emb: torch.Tensor | None) -> torch.Tensor:
        if rotary_pos_emb is None:
            return t
        rotated = apply_rotary_pos_emb(t, rotary_pos_emb, self.config.rotary_interleaved)
        return rotated if self.concentration == 1.0 else rotated * self.concentration

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        if self.config.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)
        else:
            q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(hidden_states)))
        s, b, _ = q.shape
        q_nope, q_pe = q.view(s, b, self.heads_per_rank, self.qk + self.pe).split([self.qk, self.pe], dim=-1)
        latent, k_pe = self.linear_kv_down_proj(hidden_states).split([self.config.kv_lora_rank, self.pe], dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(latent))
        k_nope, v = kv.view(s, b, self.heads_per_rank, self.qk + self.v).split([self.qk, self.v], dim=-1)
        # the shared rotated key: every rank's heads read it (its gradient summed over TP)
        if self.sequence_parallel:
            k_pe = gather_from_sequence_parallel_region(k_pe, self.tp_group)
        else:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        q_pe = self._rotate(q_pe, rotary_pos_emb)
        k_pe = self._rotate(k_pe.unsqueeze(2), rotary_pos_emb).expand(-1, -1, self.heads_per_rank, -1)
        q, k = torch.cat([q_nope, q_pe], dim=-1), torch.cat([k_nope, k_pe], dim=-1)
        padded = inference_context is not None or self.pad_heads
        if padded:
            q, k, v = (F.pad(t, (0, mla_padded_head_dim(self.config) - t.shape[-1])) for t in (q, k, v))
        if inference_context is not None:
            context = inference_context.store_kv_and_attend(self.layer_number, q, k, v)
        elif self.config.recomputes("core_attn") and self.training:
            context = checkpoint(self.core_attention, q, k, v.contiguous(), attention_mask)
        else:
            context = self.core_attention(q, k, v.contiguous(), attention_mask)
        if padded:  # cut the values' padding
            context = context.reshape(s, b, self.heads_per_rank, -1)[..., : self.v]
        return self.linear_proj(context.reshape(s, b, -1))
