"""Context parallelism (CP): sequences sharded over the ``cp`` group with causal load
balancing (:mod:`sharding`), attention over the sharded sequence (:mod:`ring_attention`,
local blocks from :mod:`block_attention`) and the Mamba mixer's switch to head sharding
(:mod:`mamba_heads`). Losses and gradients reduce over ``dp_cp``."""

from megatron.core.config import TransformerConfig
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.context_parallel.sharding import (
    CP_COMM_TYPES,
    ContextParallelConfigError,
    ContextParallelInputError,
    chunk_ids,
    cp_size_of,
    get_batch_on_this_cp_rank,
    shard_sequence,
    unshard_sequence,
)


def check_context_parallel_config(config: TransformerConfig, pg_collection: ProcessGroupCollection) -> None:
    """Raise ContextParallelConfigError when the config's CP size disagrees with the collection's
    ``cp`` group."""
    cp = cp_size_of(pg_collection)
    if config.context_parallel_size != cp:
        raise ContextParallelConfigError(
            f"config.context_parallel_size ({config.context_parallel_size}) differs from the cp group size ({cp}); "
            "build the config for the collection (ModelRecord.config_for does)"
        )


__all__ = [
    "CP_COMM_TYPES",
    "ContextParallelConfigError",
    "ContextParallelInputError",
    "check_context_parallel_config",
    "chunk_ids",
    "cp_size_of",
    "get_batch_on_this_cp_rank",
    "shard_sequence",
    "unshard_sequence",
]
