"""Which requests run in the next step, and with how many tokens.

Each step, in this order:

1. **Blocks for the next tokens**, oldest request first (running and paused alike): a decode
   request grows (``decode_growth``; ``async_preparation`` for a pending token of overlapped
   steps), a paused one resumes (``resume``); one that cannot get its blocks is paused (keeps
   its blocks). Speculative drafts get lookahead blocks
   (``lookahead``) only when they fit; otherwise the request decodes without drafts.
2. **Eviction**: while paused requests hold more than ``paused_block_budget`` blocks, or when
   nothing can run at all, the newest paused request is evicted: it loses its blocks and is
   requeued at the head of the waiting queue, to be re-admitted with prompt = prompt +
   generated and the rest of its budget.
3. **Admission** (FIFO), only while no request is paused, while the pool (KV blocks and a Mamba
   slot, taken all or nothing), the request cap and the step's token budget allow.
4. **Tokens**: decode tokens (plus drafts) first, then prefill chunks in admission order up to
   ``max_tokens_per_step``, a splittable prompt's chunk at most ``long_prefill_token_threshold``
   tokens when that is set (vLLM's option: the step's budget goes to several prompts at once;
   one more when that finishes the prompt). A prompt is split only with chunked prefill (or when
   it is a recompute or import), and never so that its final chunk is a single token. The oldest
   prefilling request, when it may not be split and did not fit after the decode tokens in the
   last step, goes before them in this one (decode tokens that do not fit then wait a step):
   else, while any request decodes, a prompt of nearly ``max_tokens_per_step`` tokens would
   never run; decode and such prefill steps alternate, so neither side starves.
"""

from __future__ import annotations

import argparse
from collections import deque
from dataclasses import dataclass

from megatron.core.inference.contexts.block_allocator import PageReason
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, RequestState
from megatron.core.inference.contexts.errors import BlockPoolExhaustedError, StorageExhaustedError
from megatron.core.inference.engines.requests import EngineRequest, RequestStatus


def add_long_prefill_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--long-prefill-token-threshold`` (vLLM's flag) into ``args.long_prefill_token_threshold``
    (None when not given: the engine's automatic choice)."""
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="with chunked prefill, the most tokens of one prompt a step takes (0: off; default: automatic, "
        "off except for hybrid models on the CPU Mamba path)",
    )


@dataclass
class ScheduledRequest:
    request: EngineRequest
    num_tokens: int


@dataclass
class SchedulerEvents:
    """What a :meth:`Scheduler.schedule` call did (for stats)."""

    pauses: int = 0
    evictions: int = 0
    prefix_cache_hit_blocks: int = 0


class Scheduler:
    """Owns the waiting / running / paused sets of an engine (see module doc)."""

    def __init__(
        self,
        context: DynamicInferenceContext,
        *,
        max_tokens_per_step: int,
        enable_chunked_prefill: bool,
        paused_block_budget: int,
        long_prefill_token_threshold: int = 0,
    ):
        self.context = context
        self.max_tokens_per_step = max_tokens_per_step
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.paused_block_budget = paused_block_budget
        self.waiting: deque[EngineRequest] = deque()
        self.admitted: list[EngineRequest] = []  # running and paused, oldest admission first

    # ---- queries ----------------------------------------------------------------------------
    @property
    def paused(self) -> list[EngineRequest]:
        return [r for r in self.admitted if r.status is RequestStatus.PAUSED]

    def has_paused(self) -> bool:
        """Whether an admitted request is paused (:attr:`paused` non-empty, without building it)."""
        return any(r.status is RequestStatus.PAUSED for r in self.admitted)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.admitted)

    def _uncomputed(self, request: EngineRequest) -> int:
        state = self.context.request(request.request_id)
        return len(state.tokens) - state.num_computed_tokens

    @staticmethod
    def _decoding(request: EngineRequest, state: RequestState) -> bool:
        """Whether ``request`` (context state ``state``) is past its prefill: it decodes."""
        return state.num_computed_tokens >= request.prefill_target

    def short_of_blocks(self, in_flight: list[ScheduledRequest]) -> bool:
        """Whether the next schedule may pause a request: one is paused already, or the decoding
        requests' next tokens (one more for each request of ``in_flight``, the entries of a step
        still running, which samples their next token) need more fresh blocks than are free."""
        if self.has_paused():
            return True
        if len(self.admitted) <= self.context.num_free_blocks:
            return False  # a request's next token takes at most one fresh block
        growing = {id(entry.request) for entry in in_flight}
        needed = 0
        for request in self.admitted:
            state = self.context.request(request.request_id)
            if self._decoding(request, state):
                tokens = len(state.tokens) + (id(request) in growing)
                needed += max(0, self.context.blocks_for_tokens(tokens) - len(state.block_ids))
        return needed > self.context.num_free_blocks

    def _paused_blocks(self) -> int:
        return sum(len(self.context.request(r.request_id).block_ids) for r in self.paused)

    # ---- lifecycle --------------------------------------------------------------------------
    def enqueue(self, request: EngineRequest) -> None:
        self.waiting.append(request)

    def remove(self, request: EngineRequest) -> None:
        """Forget a finished or aborted request (its context state must be released already)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.admitted:
            self.admitted.remove(request)

    def schedule(self) -> tuple[list[ScheduledRequest], SchedulerEvents]:
        events = SchedulerEvents()
        with self.context.batched_page_init():  # every fresh page of the step zeroed in one call
            while True:
                self._grow_or_pause(events)
                self._evict_over_budget(events)
                runnable = [r for r in self.admitted if r.status is RequestStatus.ACTIVE]
                if runnable or not self.has_paused():
                    break
                self._evict(self.paused[-1], events)  # nothing can run: make room
            if not self.has_paused():
                self._admit(events)
        return self._pack(), events

    def _grow_or_pause(self, events: SchedulerEvents) -> None:
        context = self.context
        for request in self.admitted:
            state = context.request(request.request_id)
            try:
                if request.status is RequestStatus.PAUSED:
                    context.resume_request(request.request_id)
                    request.status = RequestStatus.ACTIVE
                elif self._decoding(request, state):
                    # A pending token (overlapped steps) is grown for ahead of knowing it.
                    reason = PageReason.ASYNC_PREPARATION if state.num_pending_tokens else PageReason.DECODE_GROWTH
                    context.ensure_token_capacity(request.request_id, len(state.tokens), reason)
            except BlockPoolExhaustedError:
                if request.status is RequestStatus.ACTIVE:
                    context.pause_request(request.request_id)
                    request.status = RequestStatus.PAUSED
                    events.pauses += 1
                continue
            self._add_drafts(request)

    def _add_drafts(self, request: EngineRequest) -> None:
        drafts, request.drafts = request.drafts, []
        if not drafts:
            return
        state = self.context.request(request.request_id)
        if state.num_computed_tokens + 1 != len(state.tokens):
            return
        try:
            self.context.ensure_token_capacity(
                request.request_id, len(state.tokens) + len(drafts), PageReason.LOOKAHEAD
            )
        except BlockPoolExhaustedError:
            return
        self.context.append_draft_tokens(request.request_id, drafts)

    def _evict_over_budget(self, events: SchedulerEvents) -> None:
        while self.paused and self._paused_blocks() > self.paused_block_budget:
            self._evict(self.paused[-1], events)

    def _evict(self, request: EngineRequest, events: SchedulerEvents) -> None:
        request.hash_chain = self.context.release_request(request.request_id)
        request.status = RequestStatus.WAITING
        request.evicted = True
        self.admitted.remove(request)
        self.waiting.appendleft(request)
        events.evictions += 1

    def _admit(self, events: SchedulerEvents) -> None:
        if not self.waiting:
            return
        context = self.context
        budget = self.max_tokens_per_step - sum(min(self._uncomputed(r), 1) for r in self.admitted)
        while self.waiting and budget > 0 and context.num_requests < context.capacity.max_requests:
            request = self.waiting[0]
            cached = self._take_storage(request)
            if cached is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.ACTIVE
            request.prefill_target = len(request.context_tokens)
            self.admitted.append(request)
            events.prefix_cache_hit_blocks += cached // context.block_size
            budget -= 1

    def _take_storage(self, request: EngineRequest) -> int | None:
        """Admit ``request`` into the context, all or nothing: its blocks and its Mamba slot, or
        neither (None: storage is short now, e.g. slots held by handoff pins; it stays queued).
        Returns the number of prompt tokens found cached."""
        try:
            return self.context.add_request(
                request.request_id,
                request.context_tokens,
                max_new_tokens=request.remaining_budget - 1,
                hash_chain=request.hash_chain,
                allow_chunked_prefill=self._may_chunk(request),
            )
        except StorageExhaustedError:
            return None

    def _may_chunk(self, request: EngineRequest) -> bool:
        return self.enable_chunked_prefill or request.evicted or request.prefilled_import

    def _pack(self) -> list[ScheduledRequest]:
        budget = self.max_tokens_per_step
        scheduled = []
        decoding, prefilling = [], []  # (request, its context state), each looked up once
        for request in self.admitted:
            if request.status is RequestStatus.ACTIVE:
                state = self.context.request(request.request_id)
                (decoding if self._decoding(request, state) else prefilling).append((request, state))
        first = []  # the oldest prefill, when it goes before the decode tokens (its rows still after theirs)
        if prefilling and prefilling[0][0].prefill_deferred:
            request, state = prefilling[0]
            remaining = request.prefill_target - state.num_computed_tokens
            if remaining <= budget:
                first, prefilling = [ScheduledRequest(request, remaining)], prefilling[1:]
                budget -= remaining
                request.prefill_deferred = False
        for request, state in decoding:
            num_tokens = len(state.tokens) - state.num_computed_tokens
            if not num_tokens:  # its next token is still being sampled and ends it by length
                continue
            if num_tokens > budget:
                self._drop_drafts(request)
                num_tokens = len(state.tokens) - state.num_computed_tokens
            if num_tokens <= budget:
                scheduled.append(ScheduledRequest(request, num_tokens))
                budget -= num_tokens
        scheduled += first
        for request, state in prefilling:
            # Up to the admitted context: a token added since (the result of an overlapped step
            # that was still running at admission) is decoded after, with its own growth.
            remaining = request.prefill_target - state.num_computed_tokens
            take = min(remaining, budget)
            cap = self.long_prefill_token_threshold
            if cap and take > cap and self._may_chunk(request):
                # One token past the cap rather than a one-token final chunk.
                take = remaining if remaining == cap + 1 and remaining <= budget else cap
            if take < remaining:
                if not self._may_chunk(request):
                    request.prefill_deferred = bool(decoding) and remaining <= self.max_tokens_per_step
                    continue
                if remaining - take == 1:
                    take -= 1  # never leave a one-token final chunk
            if take >= 1:
                scheduled.append(ScheduledRequest(request, take))
                budget -= take
        return scheduled

    def _drop_drafts(self, request: EngineRequest) -> None:
        self.context.resolve_draft_tokens(request.request_id, 0)
