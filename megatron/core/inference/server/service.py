"""Shared request handling of the OpenAI routes: options, validation, engine requests per choice."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from megatron.core.errors import MegatronConfigError
from megatron.core.inference.coordinator.client import InferenceClient, RequestHandle
from megatron.core.inference.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, UnknownParserError
from megatron.core.inference.sampling import InvalidSamplingParamsError, SamplingParams
from megatron.core.inference.server import responses as R
from megatron.core.inference.server.chat_template import ChatTemplate, check_chat_template
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
# A disaggregated replica failed to move the request's KV (its prefill worker or a transfer
# failed): the request was fine, the server could not serve it now.
_HANDOFF_FAILED = {"PrefillFailedError", "TransferFailedError", "TransferSubmitError", "QuarantineFullError"}


class ServerConfigError(MegatronConfigError):
    """A server option out of range or naming an unknown parser."""


@dataclass
class ServerConfig:
    """Options of the HTTP server.

    Args:
        model_name: the one model id served (``model`` of requests must equal it).
        max_model_len: the engine's length limit (prompt plus generated tokens), reported by
            /v1/models and /tokenize; None: unknown.
        api_key: when set, /v1/ requests need ``Authorization: Bearer <api_key>``.
        max_request_bytes: larger request bodies get 413.
        max_prompt_tokens: longer prompts get 400 (``context_length_exceeded``) before reaching an
            engine; None: the engine decides.
        default_max_tokens: ``max_tokens`` of requests that give none; None: the engine's length limit.
        max_prompts_per_request: prompts one /v1/completions request may hold; more get 400.
        max_n: choices per prompt (``n``) a request may ask for; more get 400.
        max_in_flight_per_request: engine requests (one per choice) an HTTP request keeps in
            flight; its further choices are submitted as these finish, so that a large request
            takes turns with the others instead of queueing all of its choices ahead of them.
        header_timeout_s: a connection whose request head (request line and headers) is not
            complete this long after it opened, or after its previous response, is closed.
        body_timeout_s: a request body not complete this long after its head gets 408.
        kv_block_size: tokens per KV block of the engines (for the prefix-cache hit rate in
            /metrics); None: no hit rate.
        chat_template: a Jinja file or ``"plain"`` (our template) instead of the tokenizer's own
            (see :class:`~megatron.core.inference.server.chat_template.ChatTemplate`).
        reasoning_parser, reasoning_options: split chat output into reasoning_content and content.
        tool_call_parser: how chat output encodes tool calls (used when a request offers tools).
    """

    model_name: str = "megatron"
    max_model_len: int | None = None
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    default_max_tokens: int | None = None
    max_prompts_per_request: int = 256
    max_n: int = 16
    max_in_flight_per_request: int = 16
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    kv_block_size: int | None = None
    chat_template: str | None = None
    reasoning_parser: str | None = None
    reasoning_options: dict[str, Any] | None = None
    tool_call_parser: str | None = "hermes"

    def __post_init__(self):
        counts = (
            "max_model_len",
            "max_request_bytes",
            "max_prompt_tokens",
            "default_max_tokens",
            "max_prompts_per_request",
            "max_n",
        )
        for name in (*counts, "max_in_flight_per_request"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ServerConfigError(f"{name} must be a positive integer (or None where allowed), got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ServerConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        check_chat_template(self.chat_template)
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
    last_token_s: float | None = None  # when its latest tokens arrived (monotonic)

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        first, self.first = self.first, None
        return choice_deltas(self.handle, self.decoder, first)


def error_from_output(error: dict[str, Any] | None) -> APIError:
    """The HTTP error for a request whose engine output was an error."""
    error = error or {"type": "UnknownError", "message": "the engine reported an error without details"}
    kind, message = error.get("type", ""), error.get("message", "")
    if kind in _TOO_LARGE:
        return bad_request(message, code="context_length_exceeded")
    if kind in _UNAVAILABLE or kind in _HANDOFF_FAILED:
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
        self.metrics = ServerMetrics(config.kv_block_size)
        self.chat_template = ChatTemplate(tokenizer, config.chat_template)
        self.created = R.now()

    def model_card(self) -> dict[str, Any]:
        """The served model as /v1/models lists it (OpenAI's model object, with vLLM's max_model_len)."""
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "megatron",
            "max_model_len": self.config.max_model_len,
        }

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
            raise bad_request(
                f"{param} has {len(tokens)} tokens but this server accepts at most {limit}; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        return tokens

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """Refuse requests for more prompts or choices than the server's caps (400 naming the cap)."""
        config = self.config
        if n > config.max_n:
            raise bad_request(
                f"n={n} is more than this server's limit of {config.max_n} choices per prompt (max_n)",
                param="n",
                code="invalid_value",
            )
        if num_prompts > config.max_prompts_per_request:
            raise bad_request(
                f"prompt holds {num_prompts} prompts but this server accepts at most "
                f"{config.max_prompts_per_request} per request (max_prompts_per_request); send several requests",
                param="prompt",
                code="invalid_value",
            )

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
            **_control_params(body),
        )

    # -- engine requests -----------------------------------------------------------------

    async def start_choices(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, n: int
    ) -> ChoiceSet:
        """The choices of a request, started (see :meth:`ChoiceSet.start`)."""
        window = self.config.max_in_flight_per_request
        choices = ChoiceSet(self.client, request_id, prompts, params, n, window, self.metrics)
        await choices.start()
        return choices

    def account(self, choices: list[Choice], prompts: list[list[int]]) -> dict[str, int]:
        completion = sum(c.decoder.state.completion_tokens for c in choices)
        prompt = sum(len(p) for p in prompts)
        self.metrics.count_tokens(prompt, completion)
        return R.usage(prompt, completion)


class ChoiceSet:
    """The engine requests of one HTTP request: ``n`` choices per prompt, choice
    ``prompt_index * n + i`` being one engine request, submitted in index order with at most
    ``window`` unfinished at a time (each finished choice makes room for the next one).

    A choice's first output tells whether the engine admitted it: :meth:`start` waits for those
    of the first window, so their admission errors become the HTTP status; a later choice that
    is refused ends with an error delta instead.

    It times the request into ``metrics``: from its creation (the request's arrival) to each
    submission (queue time), to the first output (time to first token) and to the end of the
    last choice (end-to-end latency), and the gaps between a choice's tokens (inter-token latency).
    """

    def __init__(
        self,
        client: InferenceClient,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        window: int,
        metrics: ServerMetrics,
    ):
        self._client = client
        self._window = window
        self._metrics = metrics
        self._arrived_s = time.monotonic()
        self._first_token_s: float | None = None
        self._request_id = request_id
        self._unsubmitted = deque(
            (prompt_index * n + i, prompt, _choice_params(params, i))
            for prompt_index, prompt in enumerate(prompts)
            for i in range(n)
        )
        self.size = len(self._unsubmitted)
        self.choices: list[Choice] = []

    async def _submit_next(self) -> Choice:
        index, prompt, params = self._unsubmitted.popleft()
        self._metrics.queue_time.observe(time.monotonic() - self._arrived_s)
        handle = await self._client.submit(prompt, params, request_id=f"{self._request_id}-{index}")
        choice = Choice(index, prompt, handle, ChoiceDecoder())
        self.choices.append(choice)
        return choice

    async def start(self) -> None:
        """Submit the first window and wait for each one's first output; raises the APIError of
        an admission error (nothing stays in flight then)."""
        try:
            started = [await self._submit_next() for _ in range(min(self._window, self.size))]
            for choice in started:
                choice.first = await choice.handle.next_output()
                if choice.first["finish_reason"] == "error":
                    raise error_from_output(choice.first["error"])
                self._time_tokens(choice, len(choice.first["new_token_ids"]))
        except BaseException:
            self.abort()
            raise

    async def deltas(self) -> AsyncIterator[tuple[Choice, ChoiceDelta]]:
        """Deltas of all choices as they arrive, submitting the rest as room frees up; closing
        the iterator aborts what is unfinished."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Future] = []

        async def pump(choice: Choice) -> None:
            try:
                first = choice.first
                async for delta in choice.deltas():
                    if first is None:
                        self._time_tokens(choice, len(delta.token_ids))
                    first = None
                    queue.put_nowait((choice, delta))
            finally:
                queue.put_nowait((choice, None))

        tasks += [asyncio.ensure_future(pump(choice)) for choice in self.choices]
        try:
            running = len(tasks)
            while running:
                choice, delta = await queue.get()
                if delta is not None:
                    yield choice, delta
                    continue
                running -= 1
                if self._unsubmitted:
                    tasks.append(asyncio.ensure_future(pump(await self._submit_next())))
                    running += 1
            self._metrics.e2e_latency.observe(time.monotonic() - self._arrived_s)
        finally:
            for task in tasks:
                task.cancel()
            self.abort()

    def _time_tokens(self, choice: Choice, count: int) -> None:
        """Time ``count`` tokens of ``choice`` that arrived now: the request's first token, or
        the gap since the choice's previous ones (spread over the tokens that came together)."""
        if not count:
            return
        now = time.monotonic()
        if self._first_token_s is None:
            self._first_token_s = now
            self._metrics.time_to_first_token.observe(now - self._arrived_s)
        if choice.last_token_s is not None:
            for _ in range(count):
                self._metrics.inter_token_latency.observe((now - choice.last_token_s) / count)
        choice.last_token_s = now

    def abort(self) -> None:
        """Abort every submitted choice that has not finished; submit no more."""
        self._unsubmitted.clear()
        for choice in self.choices:
            if not choice.handle.done:
                choice.handle.abort()


def _control_params(body) -> dict:
    """The sampling controls a request set (SamplingParams checks their values)."""
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "stop_token_ids")
    controls = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if body.logit_bias:
        controls["logit_bias"] = {_token_id_key(key): bias for key, bias in body.logit_bias.items()}
    return controls


def _token_id_key(key: str) -> int:
    if not key.isdigit() or not key.isascii():
        raise InvalidSamplingParamsError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
    return int(key)


def _choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The parameters of a prompt's ``i``-th choice: a seeded request seeds each choice differently."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % 2**64)
