"""The error type for dataset settings that cannot be honoured."""

from megatron.core.errors import MegatronConfigError


class DatasetConfigError(MegatronConfigError):
    """Bad dataset settings (split string, sequence length, sample counts); the message names
    the flag at fault and what would be accepted."""
