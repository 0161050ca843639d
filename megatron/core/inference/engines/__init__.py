"""The dynamic inference engine (continuous batching over the paged context), its requests,
scheduler, speculative decoding and typed errors."""

from megatron.core.inference.engines.cuda_graphs import add_cuda_graph_flag
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.engines.errors import (
    EngineConfigError,
    InvalidPromptError,
    MaxSequenceLengthOverflowError,
    StopSequencesNeedTokenizerError,
)
from megatron.core.inference.engines.requests import RequestOutput, RequestStatus
from megatron.core.inference.engines.scheduler import add_long_prefill_flag
from megatron.core.inference.errors import DuplicateRequestIdError

__all__ = [
    "DuplicateRequestIdError",
    "DynamicInferenceEngine",
    "EngineConfigError",
    "InvalidPromptError",
    "MaxSequenceLengthOverflowError",
    "RequestOutput",
    "RequestStatus",
    "StopSequencesNeedTokenizerError",
    "add_cuda_graph_flag",
    "add_long_prefill_flag",
]
