"""Typed errors of the dynamic inference engine.

Request errors (:class:`~megatron.core.inference.errors.RequestRejectedError` subclasses)
travel to clients: they serialize with ``to_dict`` / ``from_dict``. Together with the context's
admission errors (``PromptTooLongError``, ``RequestExceedsPoolError``,
``PromptExceedsStepTokenLimitError``) and
:class:`~megatron.core.inference.errors.DuplicateRequestIdError` they are what
:meth:`DynamicInferenceEngine.add_request` raises; the engine keeps serving its other requests.

:class:`EngineConfigError` is a misconfigured engine (raised at construction).
"""

from __future__ import annotations

from megatron.core.errors import MegatronConfigError
from megatron.core.inference.errors import RequestRejectedError


class MaxSequenceLengthOverflowError(RequestRejectedError):
    """Prompt plus requested new tokens exceed the model's maximum sequence length."""

    fields = ("prompt_length", "max_tokens", "max_sequence_length")

    def describe(self, prompt_length, max_tokens, max_sequence_length):
        return (
            f"prompt of {prompt_length} tokens plus max_tokens={max_tokens} exceeds the maximum sequence "
            f"length {max_sequence_length}; ask for at most {max(max_sequence_length - prompt_length, 0)} new "
            f"tokens (at least 1 must fit)"
        )


class InvalidPromptError(RequestRejectedError):
    """Empty prompt, or token ids outside the vocabulary."""

    fields = ("reason", "vocab_size")

    def describe(self, reason, vocab_size):
        return f"invalid prompt: {reason}; send a non-empty list of token ids in [0, {vocab_size})"


class LogitBiasTokenOutOfRangeError(RequestRejectedError):
    """``logit_bias`` names token ids outside the model's vocabulary."""

    fields = ("token_ids", "vocab_size")

    def describe(self, token_ids, vocab_size):
        return f"logit_bias holds token ids {token_ids} outside the vocabulary; send ids in [0, {vocab_size})"


class StopTokenIdsOutOfRangeError(RequestRejectedError):
    """``stop_token_ids`` names token ids outside the model's vocabulary."""

    fields = ("token_ids", "vocab_size")

    def describe(self, token_ids, vocab_size):
        return f"stop_token_ids holds token ids {token_ids} outside the vocabulary; send ids in [0, {vocab_size})"


class StopSequencesNeedTokenizerError(RequestRejectedError):
    """Stop sequences sent to an engine without a tokenizer (it cannot see text)."""

    fields = ("stop",)

    def describe(self, stop):
        return f"stop sequences {stop!r} need an engine built with a tokenizer; this one has none, send no stop"


class EngineConfigError(MegatronConfigError):
    """The engine was configured with values it does not accept (message names them)."""
