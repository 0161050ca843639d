"""POST /v1/chat/completions: messages -> an assistant turn, with reasoning and tool calls split out."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, Response

from megatron.core.inference.parsers import ToolCallEvent, build_output_parser, collect
from megatron.core.inference.prompts import tokenize_prompt
from megatron.core.inference.server import responses as R
from megatron.core.inference.server.errors import bad_request
from megatron.core.inference.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from megatron.core.inference.server.service import OpenAIService, error_from_output
from megatron.core.inference.server.streaming import EventStreamResponse
from megatron.core.inference.server.structured_output import structured_output
from megatron.core.tokenizers import TokenizerError


def offered_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools of a request as OpenAI tool dicts (None when there are none)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _tools(service: OpenAIService, body: ChatCompletionRequest) -> tuple[list[dict] | None, list[dict] | None]:
    """(tools shown to the model, tools whose calls are parsed out of the output); with
    ``tool_choice: "none"`` neither."""
    tools = offered_tools(body.tools)
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise bad_request("tool_choice needs a non-empty tools list", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t["function"]["name"] for t in tools}:
        raise bad_request(
            f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice"
        )
    if choice == "none":
        return None, None
    return tools, None if service.config.tool_call_parser is None else tools


class _ChatChoice:
    """Per-choice state: the output parser and what it produced."""

    def __init__(self, service: OpenAIService, body: ChatCompletionRequest, parsed_tools):
        config = service.config
        self.tokenizer = service.tokenizer
        self.parser = build_output_parser(
            config.reasoning_parser,
            config.tool_call_parser if parsed_tools else None,
            tools=parsed_tools,
            reasoning_options=config.reasoning_options,
        )
        self.want_logprobs = body.logprobs
        self.num_top = body.top_logprobs or 0
        self.made_tool_calls = False

    def events(self, delta) -> list:
        events = self.parser.feed(delta.text) if delta.text else []
        if delta.finish_reason is not None:
            events += self.parser.finish()
        self.made_tool_calls |= any(isinstance(event, ToolCallEvent) for event in events)
        return events

    def logprobs(self, delta) -> list[dict[str, Any]]:
        return R.chat_logprobs_content(
            self.tokenizer, delta.token_ids, delta.log_probs, delta.top_log_probs, self.num_top
        )

    def finish_reason(self, reason: str | None) -> str | None:
        return None if reason is None else R.chat_finish_reason(reason, self.made_tool_calls)


def chat_prompt(
    service: OpenAIService,
    messages: list[ChatMessage],
    tools: list[dict] | None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt token ids of a chat: what the model sees."""
    dumped = [message.model_dump(exclude_none=True) for message in messages]
    try:
        prompt_text = service.chat_template.render(dumped, tools, add_generation_prompt, chat_template_kwargs)
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from exc
    return tokenize_prompt(service.tokenizer, prompt_text)


async def chat_completions(service: OpenAIService, body: ChatCompletionRequest) -> Response:
    service.check_model(body.model)
    service.check_fan_out(1, body.n)
    tools, parsed_tools = _tools(service, body)
    prompt = service.check_prompt(
        chat_prompt(service, body.messages, tools, chat_template_kwargs=body.chat_template_kwargs), "messages"
    )
    params = service.sampling_params(
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        echo_logprobs=False,
    )
    grammar = structured_output(body, tools, service.config.tool_call_parser)
    params = dataclasses.replace(params, structured_output=grammar)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = await service.start_choices(request_id, [prompt], params, body.n)
    states = {index: _ChatChoice(service, body, parsed_tools) for index in range(choices.size)}
    created = R.now()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(
            _stream(service, body, request_id, created, prompt, choices, states, include_usage), on_close=choices.abort
        )
    events: dict[int, list] = {index: [] for index in states}
    logprobs: dict[int, list] = {index: [] for index in states}
    reasons: dict[int, str] = {}
    service.metrics.running.inc()
    try:
        async with aclosing(choices.deltas()) as deltas:
            async for choice, delta in deltas:
                if delta.finish_reason == "error":
                    raise error_from_output(delta.error)
                state = states[choice.index]
                events[choice.index] += state.events(delta)
                logprobs[choice.index] += state.logprobs(delta) if state.want_logprobs else []
                if delta.finish_reason is not None:
                    reasons[choice.index] = state.finish_reason(delta.finish_reason)
    finally:
        service.metrics.running.dec()
    result = [
        _whole_choice(
            service, index, events[index], logprobs[index] if states[index].want_logprobs else None, reasons[index]
        )
        for index in sorted(events)
    ]
    usage = service.account(choices.choices, [prompt])
    return JSONResponse(R.envelope("chat.completion", request_id, body.model, created, result, usage=usage))


def _whole_choice(service: OpenAIService, index: int, events: list, logprobs, finish_reason: str) -> dict[str, Any]:
    parsed = collect(events)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
    if service.config.reasoning_parser is not None:
        message["reasoning_content"] = parsed.reasoning or None
    if parsed.tool_calls:
        message["tool_calls"] = [R.tool_call_dict(call, with_index=False) for call in parsed.tool_calls]
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }


async def _stream(service, body, request_id, created, prompt, choices, states, include_usage) -> AsyncIterator[str]:
    def chunk(choice_dicts: list, **extra) -> str:
        return R.sse(R.envelope("chat.completion.chunk", request_id, body.model, created, choice_dicts, **extra))

    service.metrics.running.inc()
    try:
        for index in states:
            opening = {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield chunk([opening])
        async with aclosing(choices.deltas()) as deltas:
            async for choice, delta in deltas:
                if delta.finish_reason == "error":
                    yield R.sse(error_from_output(delta.error).body())
                    continue
                state = states[choice.index]
                content = state.events(delta)
                part = {
                    "index": choice.index,
                    "delta": R.chat_delta(content),
                    "logprobs": {"content": state.logprobs(delta)} if state.want_logprobs else None,
                    "finish_reason": state.finish_reason(delta.finish_reason),
                }
                if part["delta"] or part["finish_reason"] is not None or (state.want_logprobs and delta.token_ids):
                    yield chunk([part])
        usage = service.account(choices.choices, [prompt])
        if include_usage:
            yield chunk([], usage=usage)
        yield R.SSE_DONE
    finally:
        service.metrics.running.dec()
