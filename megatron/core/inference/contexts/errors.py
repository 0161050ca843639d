"""Typed errors of the inference context.

Two families:

* admission errors (:class:`~megatron.core.inference.errors.RequestRejectedError` subclasses):
  a request that cannot be admitted. They travel to the client (through the engine and
  coordinator) in the wire format of :mod:`megatron.core.inference.errors`.
* :class:`InferenceContextError` — the context was given settings or calls it does not accept
  (unknown request, layer not on this stage, pool exhausted, capacity that cannot hold one
  request).

Both are ``ValueError`` subclasses whose message says what was wrong and what is accepted.
:class:`CapacityNegotiationTimeoutError` is not: it is a runtime fault (a stage that never
joined the negotiation), not a bad setting.
"""

from __future__ import annotations

from megatron.core.errors import MegatronInputError, MegatronRuntimeError
from megatron.core.inference.errors import RequestRejectedError


class PromptTooLongError(RequestRejectedError):
    """The prompt is longer than the model's maximum sequence length."""

    fields = ("prompt_length", "max_sequence_length")

    def describe(self, prompt_length, max_sequence_length):
        return (
            f"prompt has {prompt_length} tokens but the maximum sequence length is "
            f"{max_sequence_length}; send a prompt of at most {max_sequence_length} tokens"
        )


class RequestExceedsPoolError(RequestRejectedError):
    """Prompt plus token budget needs more KV blocks than the whole pool holds."""

    fields = ("num_tokens", "blocks_needed", "pool_blocks", "block_size")

    def describe(self, num_tokens, blocks_needed, pool_blocks, block_size):
        return (
            f"request needs {num_tokens} tokens of KV cache ({blocks_needed} blocks of {block_size}) but "
            f"the pool holds only {pool_blocks} blocks; it can never fit: ask for at most "
            f"{pool_blocks * block_size} tokens (prompt plus max new tokens)"
        )


class PromptExceedsStepTokenLimitError(RequestRejectedError):
    """Without chunked prefill, a prompt must be prefilled in one step under the token limit."""

    fields = ("prompt_length", "max_tokens_per_step")

    def describe(self, prompt_length, max_tokens_per_step):
        return (
            f"prompt has {prompt_length} tokens but one step processes at most {max_tokens_per_step} "
            f"tokens and chunked prefill is off; enable chunked prefill or send at most "
            f"{max_tokens_per_step} prompt tokens"
        )


class InferenceContextError(MegatronInputError):
    """The inference context was given settings or calls it does not accept (the message names them)."""


class StorageExhaustedError(InferenceContextError):
    """Fewer free KV blocks or Mamba state slots than asked for right now; nothing was allocated
    (the same call may succeed once requests or handoff pins give storage back)."""


class BlockPoolExhaustedError(StorageExhaustedError):
    """More KV blocks were asked for than are free; nothing was allocated."""


class MambaSlotsExhaustedError(StorageExhaustedError):
    """Every Mamba state slot is in use (by requests or by handoff pins); nothing was allocated."""


class UnknownRequestError(InferenceContextError):
    """A request id that the context does not hold (or already holds, on admission)."""


class LayerNotOnStageError(InferenceContextError):
    """A hook was called with a layer number that this pipeline stage does not hold."""


class StepError(InferenceContextError):
    """A step was built, or a hook called, with inconsistent batch contents."""


class CapacityError(InferenceContextError):
    """The memory budget cannot hold the asked-for cache (message names the limiting stage)."""

    def __init__(self, message: str, limiting_stage: int | None = None):
        super().__init__(message)
        self.limiting_stage = limiting_stage


class CapacityNegotiationTimeoutError(MegatronRuntimeError):
    """The pipeline stages did not all join the capacity negotiation in time (a stage is stuck or
    gone; no setting would have fixed it)."""
