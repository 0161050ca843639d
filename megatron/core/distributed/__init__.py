"""Data-parallel gradient handling and gradient finalization (DP, GTP, SP, tied embeddings)."""

from megatron.core.distributed.finalize_model_grads import finalize_model_grads
