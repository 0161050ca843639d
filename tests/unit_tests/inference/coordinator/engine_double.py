"""A small deterministic engine that implements the engine contract, for serving tests.

Generated token ``i`` of a prompt is a lowercase ASCII letter picked by a hash of
(prompt, i) (:func:`expected_tokens`), one token per step for every active request.
Requests move waiting -> active (at most ``max_active`` at a time) -> finished; a test can
also park an active request in the ``paused`` state (as memory pressure would) with
:meth:`HashEngine.park`. Aborts are honored in every state with one terminal output. Text and
stop sequences come from the engine's own :class:`TextStream` over the byte-level tokenizer,
with the engine's finish rules (EOS, then a completed stop sequence, then the length budget).

It produces only what :class:`DynamicInferenceEngine` produces: its outputs are the engine's
own :class:`RequestOutput`, its ``stats`` have the engine's keys, and it refuses bad requests
with the engine's typed errors (test_engine_double.py holds it to that against the real engine).
Like the engine with ``overlap_steps=False``, a step reports the tokens it made.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron.core.inference.contexts.errors import PromptTooLongError
from megatron.core.inference.engines.errors import InvalidPromptError, MaxSequenceLengthOverflowError
from megatron.core.inference.engines.requests import RequestOutput
from megatron.core.inference.errors import DuplicateRequestIdError
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.text_stream import TextStream
from megatron.core.tokenizers import ByteLevelTokenizer

EOS_ID = 257  # the byte-level tokenizer's <eos>
TOKENIZER = ByteLevelTokenizer()
VOCAB_SIZE = TOKENIZER.vocab_size


def expected_token(prompt_tokens: Sequence[int], index: int) -> int:
    """The ``index``-th generated token for ``prompt_tokens`` (a letter a-z)."""
    return ord("a") + zlib.crc32(f"{list(prompt_tokens)}/{index}".encode()) % 26


def expected_tokens(prompt_tokens: Sequence[int], count: int) -> list[int]:
    return [expected_token(prompt_tokens, i) for i in range(count)]


def token_log_prob(token: int) -> float:
    return -((token % 5) + 1) / 8


def top_log_probs(token: int, count: int) -> list[tuple[int, float]]:
    """The double's ``count`` most likely tokens at a position where it generated ``token``: that
    token first, then the next letters (cyclically), each 0.5 less likely than the one before."""
    others = [ord("a") + (token - ord("a") + j) % 26 for j in range(1, count)]
    return [(t, token_log_prob(token) - 0.5 * j) for j, t in enumerate([token, *others])]


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    text: TextStream
    state: str = "waiting"  # waiting | active | paused
    generated: list[int] = field(default_factory=list)
    first_output_sent: bool = False
    aborted: bool = False


class HashEngine:
    """Deterministic engine double.

    Args:
        max_active: requests generating at once; the rest wait.
        step_delay_s: sleep per step (a slow engine).
        eos_at: generate EOS as token number ``eos_at`` (0-based) unless ``ignore_eos``.
        script: prompt tokens -> the whole output to generate (then EOS), or None for the hash.
        max_sequence_length: longer prompts are refused with PromptTooLongError, and prompt plus
            max_tokens beyond it with MaxSequenceLengthOverflowError (the engine's checks).
    """

    def __init__(
        self,
        *,
        max_active: int = 1 << 30,
        step_delay_s: float = 0.0,
        eos_at: int | None = None,
        script: Callable[[list[int]], list[int] | None] | None = None,
        max_sequence_length: int = 4096,
    ):
        self.max_active = max_active
        self.step_delay_s = step_delay_s
        self.eos_at = eos_at
        self.script = script
        self.max_sequence_length = max_sequence_length
        self.requests: dict[str, _Request] = {}
        self.paused = False
        self.steps = 0
        self.tokens_generated = 0
        self.log: list[tuple] = []  # every call that changes state, in order
        self.finished: dict[str, str] = {}  # request id -> finish reason
        self._lock = threading.Lock()

    # -- contract ------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_tokens: list[int], sampling_params: SamplingParams, *, prefilled_import=False
    ):
        with self._lock:
            self.log.append(("add", request_id))
            prompt = prompt_token_ids(prompt_tokens, TOKENIZER)
            self._check(request_id, prompt, sampling_params)
            self.requests[request_id] = _Request(prompt, sampling_params, TextStream(TOKENIZER, sampling_params.stop))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.log.append(("abort", request_id))
            if request_id in self.requests:
                self.requests[request_id].aborted = True

    def pause(self) -> None:
        self.log.append(("pause",))
        self.paused = True

    def resume(self) -> None:
        self.log.append(("resume",))
        self.paused = False

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def stats(self) -> dict:
        """The engine's stats keys; the counters it has no notion of stay zero."""
        states = [r.state for r in self.requests.values()]
        return dict(
            steps=self.steps,
            pauses=0,
            evictions=0,
            prefix_cache_hits=0,
            prefill_tokens_computed=0,
            tokens_generated=self.tokens_generated,
            drafts_accepted=0,
            drafts_rejected=0,
            graph_steps=0,
            graph_mixed_steps=0,
            queue_depth=states.count("waiting"),
            active_requests=states.count("active"),
            paused_requests=states.count("paused"),
            kv_usage_fraction=states.count("active") / max(1, min(self.max_active, 64)),
        )

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        with self._lock:
            self.steps += 1
            self.log.append(("step",))
            outputs = [self._finish(rid, "abort") for rid, r in list(self.requests.items()) if r.aborted]
            if self.paused:
                return outputs
            active = sum(r.state == "active" for r in self.requests.values())
            for request in self.requests.values():
                if request.state == "waiting" and active < self.max_active:
                    request.state, active = "active", active + 1
            for rid, request in list(self.requests.items()):
                if request.state == "active":
                    outputs.append(self._generate(rid, request))
            return outputs

    # -- test hooks ----------------------------------------------------------------------

    def park(self, request_id: str) -> None:
        """Move an active request to the paused state (kept, not generating)."""
        with self._lock:
            self.requests[request_id].state = "paused"

    def state_of(self, request_id: str) -> str | None:
        request = self.requests.get(request_id)
        return None if request is None else request.state

    # -- internals -----------------------------------------------------------------------

    def _check(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """The engine's admission checks, in its order (DynamicInferenceEngine.check_request)."""
        if request_id in self.requests:
            raise DuplicateRequestIdError(request_id=request_id)
        if not prompt or any(not 0 <= t < VOCAB_SIZE for t in prompt):
            raise InvalidPromptError(
                reason="empty prompt" if not prompt else "token id out of range", vocab_size=VOCAB_SIZE
            )
        room = self.max_sequence_length - len(prompt)
        if len(prompt) <= self.max_sequence_length and (room < 1 or (params.max_tokens or 0) > room):
            raise MaxSequenceLengthOverflowError(
                prompt_length=len(prompt),
                max_tokens=params.max_tokens or 1,
                max_sequence_length=self.max_sequence_length,
            )
        if len(prompt) > self.max_sequence_length:
            raise PromptTooLongError(prompt_length=len(prompt), max_sequence_length=self.max_sequence_length)

    def _next_token(self, request: _Request) -> int:
        index = len(request.generated)
        planned = self.script(request.prompt) if self.script is not None else None
        if planned is not None:
            return planned[index] if index < len(planned) else EOS_ID
        if self.eos_at is not None and index == self.eos_at and not request.params.ignore_eos:
            return EOS_ID
        return expected_token(request.prompt, index)

    def _generate(self, rid: str, request: _Request) -> RequestOutput:
        token = self._next_token(request)
        request.generated.append(token)
        self.tokens_generated += 1
        limit = request.params.max_tokens or self.max_sequence_length - len(request.prompt)
        reason = None
        if token == EOS_ID and not request.params.ignore_eos:
            request.text.finish()
            reason = "stop"
        elif request.text.add_token(token):
            reason = "stop"
        elif len(request.generated) >= limit:
            reason = "stop" if request.text.finish() else "length"
        output = self._output(rid, request, [token], reason)
        if reason is not None:
            del self.requests[rid]
            self.finished[rid] = reason
        return output

    def _finish(self, rid: str, reason: str) -> RequestOutput:
        request = self.requests.pop(rid)
        self.finished[rid] = reason
        return self._output(rid, request, [], reason)

    def _output(self, rid: str, request: _Request, tokens: list[int], reason: str | None) -> RequestOutput:
        params = request.params
        prompt_log_probs = None
        if params.return_prompt_logprobs and not request.first_output_sent:
            prompt_log_probs = [-0.5] * (len(request.prompt) - 1)
        request.first_output_sent = True
        return RequestOutput(
            request_id=rid,
            new_token_ids=tokens,
            new_log_probs=[token_log_prob(t) for t in tokens] if params.logprobs else [],
            new_text=request.text.take(),
            finished=reason is not None,
            finish_reason=reason,
            error=None,
            prompt_log_probs=prompt_log_probs,
            prompt_tokens=len(request.prompt),
            generated_tokens=len(request.generated),
            new_top_log_probs=[top_log_probs(t, params.top_logprobs) for t in tokens] if params.top_logprobs else None,
        )
