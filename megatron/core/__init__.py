"""Core library: parallel layout, models, optimizers, checkpointing and inference."""

from megatron.core.errors import MegatronConfigError, MegatronError, MegatronInputError, MegatronRuntimeError

__all__ = ["MegatronConfigError", "MegatronError", "MegatronInputError", "MegatronRuntimeError"]
