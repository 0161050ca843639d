"""Typed errors of the inference context.

Two families:

* :class:`InferenceRequestError` — a request that cannot be admitted. These travel to the
  client (through the engine and coordinator), so they serialize to plain dicts
  (:meth:`~InferenceRequestError.to_dict` / :meth:`InferenceRequestError.from_dict`) that
  msgpack and JSON can carry, and they are rebuilt as the same type with the same message.
* :class:`InferenceContextError` — a caller misused the context (unknown request, layer not on
  this stage, pool exhausted, capacity that cannot hold one request).

All are ``ValueError`` subclasses whose message says what was wrong and what is accepted.
"""

from __future__ import annotations

from typing import Any, ClassVar


class InferenceRequestError(ValueError):
    """A request the context can never serve; serializable, rebuilt by :meth:`from_dict`.

    Subclasses declare their detail fields in ``fields`` and build the message from them in
    :meth:`describe`, so a round trip through :meth:`to_dict` gives an equal error.
    """

    fields: ClassVar[tuple[str, ...]] = ()
    _registry: ClassVar[dict[str, type[InferenceRequestError]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        InferenceRequestError._registry[cls.__name__] = cls

    def __init__(self, **details: Any):
        missing = [name for name in self.fields if name not in details]
        unknown = [name for name in details if name not in self.fields]
        if missing or unknown:
            raise TypeError(
                f"{type(self).__name__} takes exactly the fields {list(self.fields)}; "
                f"missing {missing}, unknown {unknown}"
            )
        self.details = details
        super().__init__(self.describe(**details))

    def describe(self, **details: Any) -> str:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    @property
    def message(self) -> str:
        return str(self)

    def to_dict(self) -> dict[str, Any]:
        """``{"type": class name, "message": str, "details": {field: value}}`` (plain values only)."""
        return {"type": type(self).__name__, "message": str(self), "details": dict(self.details)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> InferenceRequestError:
        """Rebuild the error :meth:`to_dict` described; unknown types raise ``ValueError``."""
        cls = InferenceRequestError._registry.get(data.get("type"))
        if cls is None:
            raise ValueError(
                f"unknown inference request error type {data.get('type')!r}; "
                f"known: {sorted(InferenceRequestError._registry)}"
            )
        return cls(**data["details"])

    def __eq__(self, other):
        return type(other) is type(self) and other.details == self.details

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(self.details.items()))))

    def __reduce__(self):
        return (InferenceRequestError.from_dict, (self.to_dict(),))


class PromptTooLongError(InferenceRequestError):
    """The prompt is longer than the model's maximum sequence length."""

    fields = ("prompt_length", "max_sequence_length")

    def describe(self, prompt_length, max_sequence_length):
        return (
            f"prompt has {prompt_length} tokens but the maximum sequence length is "
            f"{max_sequence_length}; send a prompt of at most {max_sequence_length} tokens"
        )


class RequestExceedsPoolError(InferenceRequestError):
    """Prompt plus token budget needs more KV blocks than the whole pool holds."""

    fields = ("num_tokens", "blocks_needed", "pool_blocks", "block_size")

    def describe(self, num_tokens, blocks_needed, pool_blocks, block_size):
        return (
            f"request needs {num_tokens} tokens of KV cache ({blocks_needed} blocks of {block_size}) but "
            f"the pool holds only {pool_blocks} blocks; it can never fit: ask for at most "
            f"{pool_blocks * block_size} tokens (prompt plus max new tokens)"
        )


class PromptExceedsStepTokenLimitError(InferenceRequestError):
    """Without chunked prefill, a prompt must be prefilled in one step under the token limit."""

    fields = ("prompt_length", "max_tokens_per_step")

    def describe(self, prompt_length, max_tokens_per_step):
        return (
            f"prompt has {prompt_length} tokens but one step processes at most {max_tokens_per_step} "
            f"tokens and chunked prefill is off; enable chunked prefill or send at most "
            f"{max_tokens_per_step} prompt tokens"
        )


class InferenceContextError(ValueError):
    """The inference context was used in a way it does not accept."""


class BlockPoolExhaustedError(InferenceContextError):
    """More KV blocks were asked for than are free; nothing was allocated."""


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


class CapacityNegotiationTimeoutError(CapacityError):
    """The pipeline stages did not all join the capacity negotiation in time."""
