"""Tensor parallelism: autograd collectives, parallel layers, GTP weight sharding, RNG, cross-entropy."""

from megatron.core.tensor_parallel import gtp
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    init_rng_scope,
    model_parallel_manual_seed,
)
from megatron.core.tensor_parallel.sharding import (
    PARALLEL_ATTRIBUTES,
    gather_full_grad,
    gather_full_parameter,
    set_parallel_attributes,
)
from megatron.core.tensor_parallel.utils import TensorParallelError, pad_vocab_size

__all__ = [
    "gtp",
    "vocab_parallel_cross_entropy",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "RNGStatesTracker",
    "checkpoint",
    "get_rng_tracker",
    "init_rng_scope",
    "model_parallel_manual_seed",
    "PARALLEL_ATTRIBUTES",
    "gather_full_grad",
    "gather_full_parameter",
    "set_parallel_attributes",
    "TensorParallelError",
    "pad_vocab_size",
]
