"""Streaming reasoning and tool-call parsers for the OpenAI-compatible server.

Build one parser per output with :func:`build_output_parser`, call ``feed(delta)`` with each
text delta and ``finish()`` at the end; the events returned are final (see ``base``).
"""

from megatron.core.inference.parsers.base import (
    Channel,
    Event,
    ParsedOutput,
    ParserFinishedError,
    StreamParser,
    TextEvent,
    ToolCallEvent,
    collect,
)
from megatron.core.inference.parsers.compose import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChatOutputParser,
    UnknownParserError,
    build_output_parser,
)
from megatron.core.inference.parsers.reasoning import (
    ReasoningParser,
    deepseek_r1_reasoning_parser,
    nemotron_reasoning_parser,
)
from megatron.core.inference.parsers.tool_calls import (
    HermesFormat,
    Qwen3CoderFormat,
    ToolCallFormat,
    ToolCallParser,
    hermes_tool_call_parser,
    qwen3_coder_tool_call_parser,
)

__all__ = [
    "Channel",
    "ChatOutputParser",
    "Event",
    "HermesFormat",
    "ParsedOutput",
    "ParserFinishedError",
    "Qwen3CoderFormat",
    "REASONING_PARSERS",
    "ReasoningParser",
    "StreamParser",
    "TOOL_CALL_PARSERS",
    "TextEvent",
    "ToolCallEvent",
    "ToolCallFormat",
    "ToolCallParser",
    "UnknownParserError",
    "build_output_parser",
    "collect",
    "deepseek_r1_reasoning_parser",
    "hermes_tool_call_parser",
    "nemotron_reasoning_parser",
    "qwen3_coder_tool_call_parser",
]
