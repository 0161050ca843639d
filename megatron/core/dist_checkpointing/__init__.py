"""Distributed checkpointing: describe each rank's pieces of global tensors and objects, validate
the combined sharding, save them once through torch.distributed.checkpoint, load any layout."""

from megatron.core.dist_checkpointing.core import (
    TRACKER_FILENAME,
    iteration_dir,
    read_latest_iteration,
    write_latest_iteration,
)
from megatron.core.dist_checkpointing.errors import CheckpointingError, CheckpointIOError, CorruptCheckpointError
from megatron.core.dist_checkpointing.exchange_utils import AssignmentCache
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.metadata import CheckpointMetadata, read_metadata
from megatron.core.dist_checkpointing.serialization import load, load_latest, save, save_iteration
from megatron.core.dist_checkpointing.sharding import (
    gtp_row_range,
    packed_column_parallel_factory,
    replica_id,
    singleton_replica_id,
)
from megatron.core.dist_checkpointing.validation import validate_records

__all__ = [
    "AssignmentCache",
    "CheckpointMetadata",
    "CheckpointIOError",
    "CheckpointingError",
    "CorruptCheckpointError",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "TRACKER_FILENAME",
    "gtp_row_range",
    "iteration_dir",
    "load",
    "load_latest",
    "packed_column_parallel_factory",
    "read_latest_iteration",
    "read_metadata",
    "replica_id",
    "save",
    "save_iteration",
    "singleton_replica_id",
    "validate_records",
    "write_latest_iteration",
]
