"""Request models of the OpenAI-compatible API (pydantic), with the ranges we accept.

Unknown fields are ignored, as OpenAI clients send fields a server may not know. Types are
strict: an integer field takes only JSON integers (not ``"10"``, ``true`` or ``10.0``), a boolean
field only ``true``/``false``, a number field integers or floats but no booleans, strings, NaN or
infinities (Python's JSON reader lets ``NaN`` and ``Infinity`` through). Every string
must be valid Unicode (JSON's ``"\\ud800"`` escapes a lone surrogate, which no text encoding
can hold: 400 naming the field). Integers that reach the engine are bounded to int64.
``stop`` is one string or a list of at most :data:`MAX_STOP_SEQUENCES` strings, each at most
:data:`MAX_STOP_SEQUENCE_CHARS` characters long. ``n`` and the number of prompts are capped by
the server's options (``ServerConfig.max_n``, ``max_prompts_per_request``).
Responses are plain dicts built in ``responses.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from megatron.core.inference.sampling import MAX_TOP_LOGPROBS

MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256
MAX_INT64 = 2**63 - 1


def lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a string, or in the strings (and keys) of nested lists and dicts."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return value[exc.start]
        return None
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    for item in items:
        found = lone_surrogate(item)
        if found is not None:
            return found
    return None


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        surrogate = lone_surrogate(value)
        if surrogate is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "holds the lone surrogate {code}, which is not Unicode text; send valid UTF-8",
                {"code": f"U+{ord(surrogate):04X}"},
            )
        return value


class StreamOptions(_Model):
    include_usage: bool = False


class _GenerationRequest(_Model):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT64, description="-1 or 0 disables top-k")
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = Field(
        None,
        description=f"one stop sequence or a list of at most {MAX_STOP_SEQUENCES}, "
        f"each at most {MAX_STOP_SEQUENCE_CHARS} characters",
    )
    n: int = Field(1, ge=1, description="choices per prompt (at most the server's max_n)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Sampling controls; their ranges are SamplingParams' (one owner), checked when it is built.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end generation like EOS")

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, stop: str | list[str] | None) -> str | list[str] | None:
        sequences = [stop] if isinstance(stop, str) else stop or []
        if len(sequences) > MAX_STOP_SEQUENCES:
            raise PydanticCustomError(
                "too_many_stop_sequences",
                "holds {count} stop sequences; at most {limit} are accepted",
                {"count": len(sequences), "limit": MAX_STOP_SEQUENCES},
            )
        longest = max(map(len, sequences), default=0)
        if longest > MAX_STOP_SEQUENCE_CHARS:
            raise PydanticCustomError(
                "stop_sequence_too_long",
                "holds a stop sequence of {length} characters; each may have at most {limit}",
                {"length": longest, "limit": MAX_STOP_SEQUENCE_CHARS},
            )
        return stop


PROMPT_SHAPES = "a string, a list of strings, a list of token ids (integers), or a list of token-id lists"


def _prompt_error(where: str) -> PydanticCustomError:
    return PydanticCustomError("prompt_shape", "{where}; send " + PROMPT_SHAPES, {"where": where})


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(
        None, ge=1, description="candidates generated per prompt; the n of highest cumulative log-prob are returned"
    )
    # Declared so that they are refused (400) rather than silently ignored: see completions.refuse_unsupported.
    suffix: str | None = None
    prompt_logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """One message for a prompt of the wrong shape, naming the first element at fault (the
        union's per-branch errors would name a branch instead)."""
        if isinstance(prompt, str) or _is_token_ids(prompt):
            return prompt
        if not isinstance(prompt, list):
            raise _prompt_error(f"is {_json_kind(prompt)}")
        if not any(isinstance(p, (str, list)) for p in prompt):  # meant as token ids
            index, item = next((i, t) for i, t in enumerate(prompt) if not _is_token_ids([t]))
            raise _prompt_error(f"element {index} is {_json_kind(item)}, not a token id")
        for index, item in enumerate(prompt):
            if isinstance(item, list) and not _is_token_ids(item):
                inner, bad = next((i, t) for i, t in enumerate(item) if not _is_token_ids([t]))
                raise _prompt_error(f"element {index}.{inner} is {_json_kind(bad)}, not a token id")
            if not isinstance(item, (str, list)):
                raise _prompt_error(f"element {index} is {_json_kind(item)}")
        if len({type(p) for p in prompt}) > 1:
            raise _prompt_error("mixes strings and token-id lists")
        return prompt


def _json_kind(value: Any) -> str:
    """How a JSON value reads to a client: "a boolean", "a number", "null"..."""
    if isinstance(value, bool):
        return "a boolean"
    kinds = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


class FunctionDefinition(_Model):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class ContentPart(_Model):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Model):
    name: str
    arguments: str


class MessageToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Model):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


class TokenizeCompletionRequest(_Model):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="a BOS in front when the tokenizer asks for one")
    return_token_strs: bool = False


class TokenizeChatRequest(_Model):
    """POST /tokenize with chat messages (vLLM's shape): the ids the chat completion would see."""

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


def _tokenize_kind(body: Any) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


# A body with ``messages`` is a chat request, any other a prompt request (so errors name one shape's fields).
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]
    | Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
    Discriminator(_tokenize_kind),
]
