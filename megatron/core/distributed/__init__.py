"""Data-parallel gradient handling and gradient finalization (DP, GTP, SP, tied embeddings)."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedConfigError,
    DistributedDataParallelConfig,
)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.param_and_grad_buffer import GradBucket, GradSyncOrderError, ParamAndGradBuffer

__all__ = [
    "DistributedConfigError",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "GradBucket",
    "GradSyncOrderError",
    "ParamAndGradBuffer",
    "finalize_model_grads",
]
