"""What a request's output must match: :class:`StructuredOutputParams`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from megatron.core.inference.structured_output.errors import InvalidStructuredOutputError


@dataclass(frozen=True)
class StructuredOutputParams:
    """The grammar of a request's output: ``prefix``, then one JSON value, then ``suffix``.

    Exactly one of:
        json_schema: a JSON schema, as JSON text (see :func:`schema_text`; equal texts share one
            compiled grammar); the value must validate against it.
        json_object: any JSON object.

    Args:
        prefix / suffix: literal text before / after the value (e.g. a tool call's delimiters).
        strict: with ``json_schema``, objects without ``additionalProperties`` take none (the
            OpenAI ``strict`` flag); otherwise they may take more properties.

    The grammar ends with the end-of-sequence token, which is the only token allowed after it.
    """

    json_schema: str | None = None
    json_object: bool = False
    prefix: str = ""
    suffix: str = ""
    strict: bool = True

    def __post_init__(self):
        if (self.json_schema is not None) == bool(self.json_object):
            raise InvalidStructuredOutputError(
                "structured output needs exactly one of json_schema (JSON text) or json_object=True, got "
                f"json_schema={self.json_schema!r} and json_object={self.json_object!r}"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise InvalidStructuredOutputError(f"json_schema must be JSON text, got {type(self.json_schema).__name__}")
        for name in ("prefix", "suffix"):
            if not isinstance(getattr(self, name), str):
                raise InvalidStructuredOutputError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("json_object", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidStructuredOutputError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def coerce(cls, value: StructuredOutputParams | dict[str, Any] | None) -> StructuredOutputParams | None:
        """``value`` itself, or the params its dict form (``dataclasses.asdict``, as messages carry it) describes."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                raise InvalidStructuredOutputError(f"unknown structured output fields {unknown}")
            return cls(**value)
        raise InvalidStructuredOutputError(
            f"structured_output must be StructuredOutputParams, its dict form or None, got {type(value).__name__}"
        )

    def describe(self) -> str:
        """A short name of the grammar, for error messages."""
        return "a JSON object" if self.json_object else "the JSON schema"


def schema_text(schema: Any) -> str:
    """``schema`` (a dict) as compact JSON text. Keys keep their order: properties are generated
    in the order the schema lists them."""
    return json.dumps(schema, separators=(",", ":"))
