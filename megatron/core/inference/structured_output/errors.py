"""Errors of structured output: bad parameters (raised where they are built) and grammars that
do not compile (a request error, answered 400 to its client only)."""

from __future__ import annotations

from megatron.core.errors import MegatronInputError
from megatron.core.inference.errors import RequestRejectedError


class InvalidStructuredOutputError(MegatronInputError):
    """A :class:`StructuredOutputParams` that names no grammar, or two, or has a bad field."""


class GrammarCompileError(RequestRejectedError):
    """The request's grammar (a JSON schema, a tool's parameters) could not be compiled, or the
    engine cannot constrain its output (no tokenizer, an unsupported tokenizer)."""

    fields = ("grammar", "reason")

    def describe(self, grammar, reason):
        return f"cannot constrain the output to {grammar}: {reason}"
