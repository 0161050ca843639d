"""``response_format`` and ``tool_choice`` of a chat request -> the grammar its output must match.

- ``response_format``: ``json_object`` (any JSON object) or ``json_schema`` (``strict: true``
  forbids properties the schema does not list, as OpenAI's strict mode does); ``text`` is free.
- ``tool_choice``: ``"required"`` (one call of any offered tool) or a named function (one call
  of it), in the Hermes format the ``hermes`` tool-call parser reads:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the arguments matching the
  tool's parameter schema. ``"auto"`` and ``"none"`` leave the output free.
"""

from __future__ import annotations

from typing import Any

from megatron.core.inference.parsers.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from megatron.core.inference.server.errors import bad_request
from megatron.core.inference.server.protocol import ChatCompletionRequest, NamedToolChoice
from megatron.core.inference.structured_output import StructuredOutputParams
from megatron.core.inference.structured_output.params import schema_text

# The tool-call parsers whose format the tool-call grammar produces.
GRAMMAR_TOOL_CALL_PARSERS = ("hermes",)
_ANY_OBJECT = {"type": "object"}


def tool_call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one Hermes call body of ``tool`` (an OpenAI tool dict)."""
    function = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or _ANY_OBJECT,
        },
        "required": ["name", "arguments"],
    }


def structured_output(
    body: ChatCompletionRequest, tools: list[dict] | None, tool_call_parser: str | None
) -> StructuredOutputParams | None:
    """The grammar of ``body``'s output (None: free text); 400 for a combination we cannot
    constrain. ``tools``: the request's tools as dicts (checked against ``tool_choice`` already)."""
    choice = body.tool_choice
    forced = tools if choice == "required" else None
    if isinstance(choice, NamedToolChoice):
        forced = [tool for tool in tools if tool["function"]["name"] == choice.function.name]
    fmt = body.response_format
    json_format = fmt is not None and fmt.type != "text"
    if forced is not None:
        if json_format:
            raise bad_request(
                f"response_format {fmt.type!r} and tool_choice forcing a tool call cannot both hold; send one",
                param="response_format",
            )
        if tool_call_parser not in GRAMMAR_TOOL_CALL_PARSERS:
            raise bad_request(
                f"tool_choice forcing a tool call needs a server started with --tool-call-parser one of "
                f"{list(GRAMMAR_TOOL_CALL_PARSERS)}; this one has {tool_call_parser!r}",
                param="tool_choice",
            )
        schemas = [tool_call_schema(tool) for tool in forced]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return StructuredOutputParams(
            json_schema=schema_text(schema), prefix=TOOL_CALL_OPEN, suffix=TOOL_CALL_CLOSE, strict=True
        )
    if not json_format:
        return None
    if fmt.type == "json_object":
        return StructuredOutputParams(json_object=True)
    if fmt.json_schema is None:
        raise bad_request(
            'response_format of type "json_schema" needs a json_schema object with a schema',
            param="response_format",
        )
    return StructuredOutputParams(json_schema=schema_text(fmt.json_schema.schema_), strict=bool(fmt.json_schema.strict))
