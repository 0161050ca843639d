"""Typed failures of distributed checkpointing."""


class CheckpointingError(ValueError):
    """A sharded state dict, checkpoint directory or request that cannot be saved or loaded.

    The message names the keys, offsets and ranks at fault and what would be accepted.
    """


class CorruptCheckpointError(CheckpointingError):
    """A checkpoint file is truncated or its bytes do not match the checksum recorded at save."""
