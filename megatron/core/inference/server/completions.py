"""POST /v1/completions: prompts (text or token ids) -> completions, whole or streamed."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, Response

from megatron.core.inference.prompts import tokenize_prompt
from megatron.core.inference.server import responses as R
from megatron.core.inference.server.errors import bad_request
from megatron.core.inference.server.generation import finite_log_prob
from megatron.core.inference.server.protocol import CompletionRequest
from megatron.core.inference.server.service import Choice, OpenAIService, error_from_output
from megatron.core.inference.server.streaming import EventStreamResponse


def prompt_token_lists(service: OpenAIService, prompt, n: int) -> list[list[int]]:
    """The request's prompts as token lists (a string, strings, token ids, or lists of ids),
    within the server's fan-out caps."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt is an empty list; send a string, token ids, or a list of them", param="prompt")
    service.check_fan_out(len(prompt), n)
    prompts = [tokenize_prompt(service.tokenizer, p) if isinstance(p, str) else list(p) for p in prompt]
    return [service.check_prompt(tokens, "prompt") for tokens in prompts]


class _CompletionChoice:
    """Per-choice rendering state: echo prefix and log-prob offsets."""

    def __init__(self, service: OpenAIService, body: CompletionRequest, choice: Choice):
        self.choice = choice
        self.want_logprobs = body.logprobs is not None
        self.echo_text = service.tokenizer.detokenize(choice.prompt_tokens) if body.echo else ""
        self.logprobs = R.CompletionLogProbs(service.tokenizer, top=bool(body.logprobs))
        self.echo_pending = body.echo

    def render(self, delta) -> dict[str, Any]:
        """The choice dict for one delta (the echoed prompt comes first, once)."""
        text, logprobs = delta.text, None
        parts = []
        if self.echo_pending:
            self.echo_pending = False
            text = self.echo_text + text
            if self.want_logprobs:
                prompt_lps = [None] + [finite_log_prob(lp) for lp in (delta.prompt_log_probs or [])]
                prompt_lps = (prompt_lps + [None] * len(self.choice.prompt_tokens))[: len(self.choice.prompt_tokens)]
                parts.append(self.logprobs.build(self.choice.prompt_tokens, prompt_lps, None))
        if self.want_logprobs:
            parts.append(self.logprobs.build(delta.token_ids, delta.log_probs, delta.top_log_probs))
            logprobs = R.merge_completion_logprobs(parts)
        return {"index": self.choice.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}


def _best_of(body: CompletionRequest) -> int:
    """Candidates per prompt: ``best_of`` (at least ``n``; not with streaming, as OpenAI's API),
    else ``n``."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise bad_request(f"best_of={body.best_of} must be at least n={body.n}", param="best_of")
    if body.stream:
        raise bad_request(
            f"best_of={body.best_of} > n={body.n} cannot be streamed (the best candidates are known only at "
            "the end); send stream=false or best_of=n",
            param="best_of",
        )
    return body.best_of


def refuse_unsupported(body: CompletionRequest) -> None:
    """A 400 for parameters OpenAI or vLLM define that this server does not implement."""
    if body.suffix is not None:
        raise bad_request("suffix is not supported (no fill-in-the-middle); leave it out", param="suffix")
    if body.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs is not supported; send echo=true with logprobs for the prompt's log-probs",
            param="prompt_logprobs",
        )


async def completions(service: OpenAIService, body: CompletionRequest) -> Response:
    service.check_model(body.model)
    refuse_unsupported(body)
    candidates = _best_of(body)
    prompts = prompt_token_lists(service, body.prompt, candidates)
    want_logprobs = body.logprobs is not None
    params = service.sampling_params(
        body,
        max_tokens=body.max_tokens,
        # best_of ranks candidates by cumulative log-prob, so it needs them either way.
        logprobs=want_logprobs or candidates > body.n,
        top_logprobs=body.logprobs or 0,
        echo_logprobs=body.echo and want_logprobs,
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = await service.start_choices(request_id, prompts, params, candidates)
    renderers = _Renderers(service, body)
    created = R.now()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(
            _stream(service, body, request_id, created, prompts, choices, renderers, include_usage),
            on_close=choices.abort,
        )
    service.metrics.running.inc()
    try:
        received: dict[int, tuple[Choice, list]] = {}
        async with aclosing(choices.deltas()) as deltas:
            async for choice, delta in deltas:
                if delta.finish_reason == "error":
                    raise error_from_output(delta.error)
                received.setdefault(choice.index, (choice, []))[1].append(delta)
    finally:
        service.metrics.running.dec()
    kept = _best_candidates(received, len(prompts), candidates, body.n)
    result = [_join([renderers.render(choice, delta) for delta in deltas]) for choice, deltas in kept]
    # Usage counts every generated token, the candidates not returned too (as vLLM does).
    usage = service.account(choices.choices, prompts)
    return JSONResponse(R.envelope("text_completion", request_id, body.model, created, result, usage=usage))


def _best_candidates(received: dict[int, tuple[Choice, list]], num_prompts: int, candidates: int, n: int) -> list:
    """Per prompt, the ``n`` candidates of highest cumulative log-prob (the earlier on a tie), in
    that order, renumbered as choices ``prompt * n + i``."""
    kept = []
    for prompt in range(num_prompts):
        group = [received[prompt * candidates + i] for i in range(candidates)]
        if candidates > n:
            group.sort(key=lambda entry: -sum(lp for delta in entry[1] for lp in delta.log_probs))
        kept += [
            (dataclasses.replace(choice, index=prompt * n + i), deltas) for i, (choice, deltas) in enumerate(group[:n])
        ]
    return kept


class _Renderers:
    """The renderer of each choice, made when its first delta arrives."""

    def __init__(self, service: OpenAIService, body: CompletionRequest):
        self._service, self._body = service, body
        self._by_index: dict[int, _CompletionChoice] = {}

    def render(self, choice: Choice, delta) -> dict[str, Any]:
        renderer = self._by_index.get(choice.index)
        if renderer is None:
            renderer = self._by_index[choice.index] = _CompletionChoice(self._service, self._body, choice)
        return renderer.render(delta)


def _join(parts: list[dict[str, Any]]) -> dict[str, Any]:
    logprobs = [p["logprobs"] for p in parts if p["logprobs"] is not None]
    return {
        "index": parts[0]["index"],
        "text": "".join(p["text"] for p in parts),
        "logprobs": R.merge_completion_logprobs(logprobs) if logprobs else None,
        "finish_reason": parts[-1]["finish_reason"],
    }


async def _stream(service, body, request_id, created, prompts, choices, renderers, include_usage) -> AsyncIterator[str]:
    service.metrics.running.inc()
    try:
        async with aclosing(choices.deltas()) as deltas:
            async for choice, delta in deltas:
                if delta.finish_reason == "error":
                    yield R.sse(error_from_output(delta.error).body())
                    continue
                chunk = renderers.render(choice, delta)
                yield R.sse(R.envelope("text_completion", request_id, body.model, created, [chunk]))
        usage = service.account(choices.choices, prompts)
        if include_usage:
            yield R.sse(R.envelope("text_completion", request_id, body.model, created, [], usage=usage))
        yield R.SSE_DONE
    finally:
        service.metrics.running.dec()
