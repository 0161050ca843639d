"""Typed failures of distributed checkpointing.

* :class:`CheckpointingError` — what the caller asked for cannot be saved or loaded: a sharded
  state dict whose pieces overlap or leave gaps, a directory that is not a (complete)
  checkpoint or already exists, a key or shape the checkpoint does not hold. A ``ValueError``.
* :class:`CheckpointIOError` — writing or reading failed at run time (the file system, or a
  failure on another rank of the save). A ``RuntimeError``: nothing the caller passed was wrong.
* :class:`CorruptCheckpointError` — a file of the checkpoint is not what was saved: truncated, a
  checksum mismatch, metadata, ``model_config.json`` or a tracker that does not parse (not
  UTF-8, not JSON, malformed). The message names the file and what was wrong. A fault of the
  data, not of the request: a ``RuntimeError``.
"""

from megatron.core.errors import MegatronInputError, MegatronRuntimeError


class CheckpointingError(MegatronInputError):
    """A sharded state dict, checkpoint directory or request that cannot be saved or loaded.

    The message names the keys, offsets and ranks at fault and what would be accepted.
    """


class CheckpointIOError(MegatronRuntimeError):
    """Writing or reading a checkpoint failed at run time; the message carries each rank's failure."""


class CorruptCheckpointError(MegatronRuntimeError):
    """A checkpoint file is truncated, does not parse, or its bytes do not match the checksum
    recorded at save; the message names the file."""
