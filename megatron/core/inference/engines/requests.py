"""Requests of the dynamic engine: their state machine and the outputs they stream.

State machine (``RequestStatus``)::

    WAITING --admit--> ACTIVE (prefill, maybe chunked; then decode) --finish--> FINISHED
               ^            |  ^
               |        pause  resume
               |            v  |
               +--evict-- PAUSED

An evicted request loses its KV blocks and is requeued at the head of the waiting queue;
when re-admitted its context prompt is the original prompt plus everything generated so far,
and its remaining budget is what is left of ``max_new_tokens``. ABORT and errors finish a
request from any state. Every request gets exactly one terminal :class:`RequestOutput`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron.core.inference.contexts.prefix_cache import BlockHashChain
from megatron.core.inference.sampling import CounterGenerator, SamplingParams
from megatron.core.inference.text_stream import TextStream


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"
    ACTIVE = "active"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step reports for one request (a streaming delta, or its terminal output).

    ``new_token_ids`` / ``new_log_probs``: tokens produced since this request's previous output
    (log-probs only when ``SamplingParams.logprobs``). ``new_top_log_probs``: with
    ``SamplingParams.top_logprobs = k``, one list per new token of the ``k`` most likely
    ``(token id, log-prob)`` pairs at that position, most likely first; None otherwise.
    ``new_text``: the text settled since then (see
    :class:`~megatron.core.inference.text_stream.TextStream`: an incomplete character or a
    possible start of a stop sequence waits for a later output; a stop sequence and what follows
    never come); the ``new_text`` of all outputs concatenate to the request's text; None when the
    engine has no tokenizer. ``generated_tokens`` counts exactly the tokens reported (a stop
    sequence ends generation at the token that completes it). ``prompt_log_probs`` (log-prob of
    prompt tokens 1..n-1) comes on the first output when ``return_prompt_logprobs``. ``error`` is
    the serialized ``InferenceRequestError`` when ``finish_reason == "error"``.
    """

    request_id: str
    new_token_ids: list[int]
    new_log_probs: list[float]
    new_text: str | None
    finished: bool
    finish_reason: str | None
    error: dict | None
    prompt_log_probs: list[float] | None
    prompt_tokens: int
    generated_tokens: int
    new_top_log_probs: list[list[tuple[int, float]]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (msgpack- and JSON-able)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestOutput:
        top = data.get("new_top_log_probs")
        if top is not None:  # pairs travel as lists
            data = dict(data, new_top_log_probs=[[(int(t), float(lp)) for t, lp in row] for row in top])
        return cls(**data)


@dataclass(eq=False)
class EngineRequest:
    """The engine's bookkeeping of one request (not part of the public API); compared by
    identity."""

    request_id: str
    prompt_tokens: list[int]
    sampling_params: SamplingParams
    max_new_tokens: int
    generator: CounterGenerator | None
    prefilled_import: bool = False
    status: RequestStatus = RequestStatus.WAITING
    generated_tokens: list[int] = field(default_factory=list)
    generated_log_probs: list[float] = field(default_factory=list)
    # One list of (token id, log-prob) pairs per generated token when top_logprobs > 0.
    generated_top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_log_probs: list[float] = field(default_factory=list)
    num_emitted: int = 0
    prompt_log_probs_sent: bool = False
    # Kept across eviction so a re-admitted request is not rehashed.
    hash_chain: BlockHashChain | None = None
    # The output text (None without a tokenizer); kept across eviction and handoff.
    text: TextStream | None = None
    drafts: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    evicted: bool = False
    # Context tokens at the last admission: below this count the request is prefilling.
    prefill_target: int = 0
    # Its unsplittable prefill did not fit beside the last step's decode tokens: it goes first next.
    prefill_deferred: bool = False

    @property
    def context_tokens(self) -> list[int]:
        """What the context holds for this request: prompt plus generated tokens."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def wants_prompt_log_probs(self) -> bool:
        return self.sampling_params.return_prompt_logprobs and len(self.prompt_log_probs) < len(self.prompt_tokens) - 1

    @property
    def remaining_budget(self) -> int:
        return self.max_new_tokens - len(self.generated_tokens)

    def take_output(self, finished: bool = False, error: dict | None = None) -> RequestOutput:
        """The delta since the last output (and mark it emitted)."""
        new = self.generated_tokens[self.num_emitted :]
        params = self.sampling_params
        new_log_probs = self.generated_log_probs[self.num_emitted :] if params.logprobs else []
        new_top = self.generated_top_log_probs[self.num_emitted :] if params.top_logprobs else None
        self.num_emitted = len(self.generated_tokens)
        prompt_log_probs = None
        if params.return_prompt_logprobs and not self.prompt_log_probs_sent and (new or finished):
            prompt_log_probs = list(self.prompt_log_probs)
            self.prompt_log_probs_sent = True
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new,
            new_log_probs=new_log_probs,
            new_text=self.text.take() if self.text is not None else None,
            finished=finished,
            finish_reason=self.finish_reason if finished else None,
            error=error,
            prompt_log_probs=prompt_log_probs,
            prompt_tokens=len(self.prompt_tokens),
            generated_tokens=len(self.generated_tokens),
            new_top_log_probs=new_top,
        )
