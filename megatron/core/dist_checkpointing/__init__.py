"""Distributed checkpointing: describe each rank's pieces of global tensors and objects, validate
the combined sharding, save them once through torch.distributed.checkpoint, load any layout."""

from megatron.core.dist_checkpointing.async_save import AsyncSaver
from megatron.core.dist_checkpointing.core import (
    SAVE_PHASES,
    TRACKER_FILENAME,
    iteration_dir,
    read_latest_iteration,
    set_phase_hook,
    write_latest_iteration,
)
from megatron.core.dist_checkpointing.errors import CheckpointingError, CheckpointIOError, CorruptCheckpointError
from megatron.core.dist_checkpointing.exchange_utils import AssignmentCache
from megatron.core.dist_checkpointing.lazy_tensor import LazyTensor
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.metadata import CheckpointMetadata, read_metadata
from megatron.core.dist_checkpointing.recovery import (
    adopt_untracked,
    retire_iterations,
    verify_checkpoint,
    verify_files,
)
from megatron.core.dist_checkpointing.serialization import (
    PreparedSave,
    load,
    load_latest,
    prepare_save,
    save,
    save_iteration,
)
from megatron.core.dist_checkpointing.sharding import (
    gtp_row_range,
    packed_column_parallel_factory,
    replica_id,
    singleton_replica_id,
)
from megatron.core.dist_checkpointing.validation import validate_records

__all__ = [
    "AssignmentCache",
    "AsyncSaver",
    "CheckpointMetadata",
    "CheckpointIOError",
    "CheckpointingError",
    "CorruptCheckpointError",
    "LazyTensor",
    "PreparedSave",
    "SAVE_PHASES",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "TRACKER_FILENAME",
    "adopt_untracked",
    "retire_iterations",
    "gtp_row_range",
    "iteration_dir",
    "load",
    "load_latest",
    "packed_column_parallel_factory",
    "prepare_save",
    "read_latest_iteration",
    "read_metadata",
    "replica_id",
    "save",
    "save_iteration",
    "set_phase_hook",
    "singleton_replica_id",
    "validate_records",
    "verify_checkpoint",
    "verify_files",
    "write_latest_iteration",
]
