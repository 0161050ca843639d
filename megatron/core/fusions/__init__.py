"""Fused ops of the layer's memory-bound parts (norms with the residual add, bias-dropout-add,
MLP activations, RoPE in the QKV split, vocab-parallel cross-entropy), each a torch reference
and a Triton kernel picked by the switch of :mod:`megatron.core.fusions.backend`. Training and
inference share them; forward-only calls (``no_grad`` / ``inference_mode``) skip autograd, and
no op synchronizes with the host, so inference can capture them in CUDA graphs. The output layer
fused with the loss is :mod:`megatron.core.fusions.linear_cross_entropy` (not re-exported here: it
builds on the tensor-parallel layers, which import this package's backend switch)."""

from megatron.core.fusions.activations import activation
from megatron.core.fusions.backend import (
    BACKEND_ENV,
    BACKENDS,
    FUSED_OPS,
    FusionBackendError,
    disabled_ops,
    fused_backend,
    fusion_backend,
    set_fusion_backend,
)
from megatron.core.fusions.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.fusions.dropout import dropout, sharded_rng_context
from megatron.core.fusions.norms import bias_dropout_add, bias_dropout_add_norm, norm, norm_and_residual
from megatron.core.fusions.rope import apply_rotary_pos_emb, split_qkv

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "FUSED_OPS",
    "FusionBackendError",
    "activation",
    "apply_rotary_pos_emb",
    "bias_dropout_add",
    "bias_dropout_add_norm",
    "disabled_ops",
    "dropout",
    "fused_backend",
    "fusion_backend",
    "norm",
    "norm_and_residual",
    "set_fusion_backend",
    "sharded_rng_context",
    "split_qkv",
    "vocab_parallel_cross_entropy",
]
