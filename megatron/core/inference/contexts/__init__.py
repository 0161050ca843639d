"""Inference contexts: paged KV cache, block pool with prefix caching, Mamba state slots,
capacity planning, and the dynamic context that ties them together for a batch step."""

from megatron.core.inference.contexts.block_allocator import BlockPool, PageReason
from megatron.core.inference.contexts.capacity import (
    Capacity,
    CapacityConfig,
    StageCacheSpec,
    plan_capacity,
    plan_stage_capacity,
)
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, ImportPlan, StepBatch
from megatron.core.inference.contexts.errors import (
    BlockPoolExhaustedError,
    CapacityError,
    CapacityNegotiationTimeoutError,
    InferenceContextError,
    LayerNotOnStageError,
    MambaSlotsExhaustedError,
    PromptExceedsStepTokenLimitError,
    PromptTooLongError,
    RequestExceedsPoolError,
    StepError,
    StorageExhaustedError,
    UnknownRequestError,
)
from megatron.core.inference.contexts.kv_cache import PagedKVCache
from megatron.core.inference.contexts.mamba_slots import MambaSnapshotStore, MambaStateShapes, MambaStateSlots
from megatron.core.inference.contexts.paged_attention import paged_attention
from megatron.core.inference.contexts.prefix_cache import BlockHashChain, hash_block
from megatron.core.inference.errors import InferenceRequestError

__all__ = [
    "BlockHashChain",
    "BlockPool",
    "BlockPoolExhaustedError",
    "Capacity",
    "CapacityConfig",
    "CapacityError",
    "CapacityNegotiationTimeoutError",
    "DynamicInferenceContext",
    "ImportPlan",
    "InferenceContextError",
    "InferenceRequestError",
    "LayerNotOnStageError",
    "MambaSlotsExhaustedError",
    "MambaSnapshotStore",
    "MambaStateShapes",
    "MambaStateSlots",
    "PageReason",
    "PagedKVCache",
    "PromptExceedsStepTokenLimitError",
    "PromptTooLongError",
    "RequestExceedsPoolError",
    "StageCacheSpec",
    "StepBatch",
    "StepError",
    "StorageExhaustedError",
    "UnknownRequestError",
    "hash_block",
    "paged_attention",
    "plan_capacity",
    "plan_stage_capacity",
]
