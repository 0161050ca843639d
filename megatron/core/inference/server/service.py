"""Shared request handling of the OpenAI routes: options, validation, engine requests per choice."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from megatron.core.errors import MegatronConfigError
from megatron.core.inference.coordinator.client import InferenceClient, RequestHandle
from megatron.core.inference.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, UnknownParserError
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.server import responses as R
from megatron.core.inference.server.errors import APIError, bad_request
from megatron.core.inference.server.generation import (
    ENGINE_WITHOUT_TOKENIZER,
    ChoiceDecoder,
    ChoiceDelta,
    choice_deltas,
)
from megatron.core.inference.server.metrics import ServerMetrics

# Engine-side errors that mean the request itself is too large.
_TOO_LARGE = {
    "PromptTooLongError",
    "RequestExceedsPoolError",
    "PromptExceedsStepTokenLimitError",
    "MaxSequenceLengthOverflowError",
}
# Errors that mean serving went away, not that the request was wrong.
_UNAVAILABLE = {
    "EngineLostError",
    "CoordinatorStoppedError",
    "CoordinatorLostError",
    "NoEngineAvailableError",
    "ClientClosedError",
}
_OVERLOADED = {"WaitingQueueFullError"}  # too many requests wait for an engine
_TIMED_OUT = {"RequestTimeoutError"}  # past the coordinator's request deadline
_SERVER_FAULTS = {"MalformedOutputError"}  # an engine answered nonsense


class ServerConfigError(MegatronConfigError):
    """A server option out of range or naming an unknown parser."""


@dataclass
class ServerConfig:
    """Options of the HTTP server.

    Args:
        model_name: the one model id served (``model`` of requests must equal it).
        api_key: when set, /v1/ requests need ``Authorization: Bearer <api_key>``.
        max_request_bytes: larger request bodies get 413.
        max_prompt_tokens: longer prompts get 413 before reaching an engine; None: the engine decides.
        default_max_tokens: ``max_tokens`` of requests that give none; None: the engine's length limit.
        reasoning_parser, reasoning_options: split chat output into reasoning_content and content.
        tool_call_parser: how chat output encodes tool calls (used when a request offers tools).
    """

    model_name: str = "megatron"
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    default_max_tokens: int | None = None
    reasoning_parser: str | None = None
    reasoning_options: dict[str, Any] | None = None
    tool_call_parser: str | None = "hermes"

    def __post_init__(self):
        for name in ("max_request_bytes", "max_prompt_tokens", "default_max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ServerConfigError(f"{name} must be a positive integer (or None where allowed), got {value!r}")
        for value, registry, what in (
            (self.reasoning_parser, REASONING_PARSERS, "reasoning_parser"),
            (self.tool_call_parser, TOOL_CALL_PARSERS, "tool_call_parser"),
        ):
            if value is not None and value not in registry:
                raise UnknownParserError(f"unknown {what} {value!r}; accepted: {', '.join(sorted(registry))}")


@dataclass
class Choice:
    """One engine request serving one choice of an HTTP request."""

    index: int
    prompt_tokens: list[int]
    handle: RequestHandle
    decoder: ChoiceDecoder
    first: dict[str, Any] | None = None

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        first, self.first = self.first, None
        return choice_deltas(self.handle, self.decoder, first)


def error_from_output(error: dict[str, Any] | None) -> APIError:
    """The HTTP error for a request whose engine output was an error."""
    error = error or {"type": "UnknownError", "message": "the engine reported an error without details"}
    kind, message = error.get("type", ""), error.get("message", "")
    if kind in _TOO_LARGE:
        return APIError(413, message, code="context_length_exceeded")
    if kind in _UNAVAILABLE:
        return APIError(503, message, type="server_error", code="unavailable")
    if kind in _OVERLOADED:
        return APIError(429, message, type="server_error", code="overloaded")
    if kind in _TIMED_OUT:
        return APIError(504, message, type="server_error", code="timeout")
    if kind in _SERVER_FAULTS:
        return APIError(500, message, type="server_error", code="engine_error")
    if kind == ENGINE_WITHOUT_TOKENIZER["type"]:
        return APIError(500, message, type="server_error", code="engine_without_tokenizer")
    # Anything else the engine refused was about this request (admission, sampling values).
    return bad_request(message, code="invalid_request")


class OpenAIService:
    """Request handling shared by the routes; owns the metrics."""

    def __init__(self, client: InferenceClient, tokenizer, config: ServerConfig):
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = ServerMetrics()
        self.created = R.now()

    # -- validation ----------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_prompt(self, tokens: list[int], param: str) -> list[int]:
        if not tokens:
            raise bad_request(f"{param} is empty; send at least one token", param=param, code="invalid_value")
        vocab = self.tokenizer.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"{param} holds token ids {bad[:5]} outside 0..{vocab - 1}", param=param, code="invalid_value"
            )
        limit = self.config.max_prompt_tokens
        if limit is not None and len(tokens) > limit:
            raise APIError(
                413,
                f"{param} has {len(tokens)} tokens but this server accepts at most {limit}; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        return tokens

    def sampling_params(
        self, body, max_tokens: int | None, logprobs: bool, top_logprobs: int, echo_logprobs: bool
    ) -> SamplingParams:
        """The engine's parameters of a request (InvalidSamplingParamsError and, for ``stop``,
        InvalidStopSequencesError answer 400)."""
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=max(0, body.top_k or 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            max_tokens=max_tokens or self.config.default_max_tokens,
            stop=body.stop,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            return_prompt_logprobs=echo_logprobs,
        )

    # -- engine requests -----------------------------------------------------------------

    async def start_choices(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, n: int
    ) -> list[Choice]:
        """Submit ``n`` choices per prompt and wait for each one's first output."""
        choices: list[Choice] = []
        try:
            for prompt_index, prompt in enumerate(prompts):
                for i in range(n):
                    index = prompt_index * n + i
                    seeded = (
                        params
                        if params.seed is None or i == 0
                        else dataclasses.replace(params, seed=(params.seed + i) % 2**64)
                    )
                    handle = await self.client.submit(prompt, seeded, request_id=f"{request_id}-{index}")
                    choices.append(Choice(index, prompt, handle, ChoiceDecoder()))
            for choice in choices:
                choice.first = await choice.handle.next_output()
                if choice.first["finish_reason"] == "error":
                    raise error_from_output(choice.first["error"])
        except BaseException:
            abort_all(choices)
            raise
        return choices

    def account(self, choices: list[Choice], prompts: list[list[int]]) -> dict[str, int]:
        completion = sum(c.decoder.state.completion_tokens for c in choices)
        prompt = sum(len(p) for p in prompts)
        self.metrics.count_tokens(prompt, completion)
        return R.usage(prompt, completion)


def abort_all(choices: list[Choice]) -> None:
    for choice in choices:
        if not choice.handle.done:
            choice.handle.abort()


async def merged_deltas(choices: list[Choice]) -> AsyncIterator[tuple[Choice, ChoiceDelta]]:
    """Deltas of all choices as they arrive; closing the iterator aborts what is unfinished."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.deltas():
                queue.put_nowait((choice, delta))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        remaining = len(tasks)
        while remaining:
            choice, delta = await queue.get()
            if delta is None:
                remaining -= 1
            else:
                yield choice, delta
    finally:
        for task in tasks:
            task.cancel()
        abort_all(choices)
