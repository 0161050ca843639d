"""The dynamic inference engine: continuous batching over a paged KV cache.

``add_request`` validates and queues; each ``step`` schedules (see :mod:`scheduler`: growth,
pausing, eviction, admission, chunked prefill), runs the model over the packed step
(:mod:`model_runner`, any TP/PP layout), samples on the last pipeline stage (greedy,
temperature, top-k, top-p, per-request seeds; speculative drafts verified, see
:mod:`speculative`), shares those decisions with every stage as one tensor (see
:mod:`step_decisions`), and returns streaming outputs. Every stage then derives each request's
finish from the shared tokens by the same code: EOS, the length budget, or a stop sequence
completed in the request's text (each request's :class:`~megatron.core.inference.text_stream.TextStream`
detokenizes incrementally on every stage; outputs carry its text deltas). Every rank of a
model-parallel group runs its own engine with the same calls in the same order; all stay in
lockstep.

Steps are padded to ``max_tokens_per_step`` tokens (``batch_invariant``, the default) and the
reference kernels are batch invariant, so a request's tokens and log-probs do not depend on what else ran with it: a
tight pool (pauses, evictions), chunked prefill, prefix caching and speculation give exactly
the outputs of a roomy pool.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megatron.core.inference import kernels
from megatron.core.inference.contexts.capacity import CapacityConfig
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, RequestState, StepBatch
from megatron.core.inference.engines.errors import (
    EngineConfigError,
    InvalidPromptError,
    MaxSequenceLengthOverflowError,
    StopSequencesNeedTokenizerError,
)
from megatron.core.inference.engines.requests import EngineRequest, RequestOutput, RequestStatus
from megatron.core.inference.engines.scheduler import ScheduledRequest, Scheduler
from megatron.core.inference.engines.speculative import MTPDrafter
from megatron.core.inference.engines.step_decisions import Decision, DecisionLayout
from megatron.core.inference.errors import DuplicateRequestIdError
from megatron.core.inference.model_runner import ModelRunner, model_is_hybrid, stage_cache_spec
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams, make_generator, sample, token_logprobs
from megatron.core.inference.text_stream import TextStream
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection

_SEED_MIX = 0x9E3779B97F4A7C15


class DynamicInferenceEngine:
    """Serves generation requests on one model replica (one model-parallel group).

    Args:
        model: this rank's GPTModel / HybridModel stage (put in eval mode).
        tokenizer: optional; gives the EOS id, the outputs' text and stop sequences (requests with
            ``stop`` need it).
        block_size: tokens per KV block.
        num_blocks / buffer_size_bytes / max_requests: cache capacity (see ``CapacityConfig``).
        max_tokens_per_step: tokens one step processes (every step is padded to this).
        max_sequence_length: longest prompt + generation (default: the model's).
        enable_prefix_caching / enable_chunked_prefill: features.
        paused_block_budget: blocks paused requests may hold before the newest is evicted
            (default: half the pool).
        num_speculative_tokens: MTP drafts per decode step (0: off).
        eos_token_id: stops generation unless ``ignore_eos`` (default: the tokenizer's).
        seed: base of the generators of requests without a seed.
        batch_invariant: pad every step to ``max_tokens_per_step`` tokens so that outputs do
            not depend on batch composition (see module doc); False runs each step at its real
            size (faster when steps are small; outputs may then differ in the last bits).
        pg_collection: the model's process groups.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        buffer_size_bytes: int | None = None,
        max_requests: int | None = None,
        max_tokens_per_step: int = 256,
        max_sequence_length: int | None = None,
        enable_prefix_caching: bool = False,
        enable_chunked_prefill: bool = False,
        paused_block_budget: int | None = None,
        num_speculative_tokens: int = 0,
        eos_token_id: int | None = None,
        seed: int = 0,
        batch_invariant: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        pg = resolve_pg_collection(pg_collection)
        if model.config.sequence_parallel:
            raise EngineConfigError(
                "inference runs without sequence parallelism; build the model with sequence_parallel=False"
            )
        if max_tokens_per_step < 1 or num_speculative_tokens < 0:
            raise EngineConfigError(
                f"max_tokens_per_step must be >= 1 and num_speculative_tokens >= 0, got {max_tokens_per_step} "
                f"and {num_speculative_tokens}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, pg)
        self.max_sequence_length = max_sequence_length or model.max_sequence_length
        self.max_tokens_per_step = max_tokens_per_step
        self.batch_invariant = batch_invariant
        self.pad_steps_to = max_tokens_per_step if batch_invariant else None
        self.context = DynamicInferenceContext.create(
            stage_cache_spec(model, block_size, pg.size("tp")),
            CapacityConfig(buffer_size_bytes=buffer_size_bytes, num_blocks=num_blocks, max_requests=max_requests),
            max_sequence_length=self.max_sequence_length,
            max_tokens_per_step=max_tokens_per_step,
            is_hybrid_model=model_is_hybrid(model),
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            pg_collection=pg,
            device=self.runner.device,
        )
        pool_blocks = self.context.capacity.num_blocks
        budget = pool_blocks // 2 if paused_block_budget is None else paused_block_budget
        if budget < 0:
            raise EngineConfigError(f"paused_block_budget must be >= 0, got {paused_block_budget}")
        self.scheduler = Scheduler(
            self.context,
            max_tokens_per_step=max_tokens_per_step,
            enable_chunked_prefill=enable_chunked_prefill,
            paused_block_budget=budget,
        )
        self.drafter = MTPDrafter(self.runner, num_speculative_tokens) if num_speculative_tokens else None
        self.num_speculative_tokens = num_speculative_tokens
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos", None)
        self.seed = seed
        self._requests: dict[str, EngineRequest] = {}
        self._pending: list[RequestOutput] = []
        self._num_added = 0
        self._stepping_paused = False
        self.step_bookkeeping_s: list[float] = []
        self._stats = dict(
            steps=0,
            pauses=0,
            evictions=0,
            prefix_cache_hits=0,
            prefill_tokens_computed=0,
            tokens_generated=0,
            drafts_accepted=0,
            drafts_rejected=0,
        )

    # ---- public API -------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """Counters since creation, plus the current queue depth and KV usage."""
        capacity = self.context.capacity.num_blocks
        return dict(
            self._stats,
            queue_depth=len(self.scheduler.waiting),
            active_requests=len(self.scheduler.admitted) - len(self.scheduler.paused),
            paused_requests=len(self.scheduler.paused),
            kv_usage_fraction=(capacity - self.context.num_free_blocks) / capacity,
        )

    def add_request(
        self,
        request_id: str,
        prompt_tokens: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        prefilled_import: bool = False,
    ) -> None:
        """Queue a request, or raise its typed ``InferenceRequestError`` (nothing is queued;
        other requests are unaffected). ``prefilled_import``: its KV was computed elsewhere, so
        the per-step prompt token limit does not apply (length and pool checks still do).
        Text prompts: see :func:`~megatron.core.inference.prompts.prompt_token_ids`."""
        params = sampling_params or SamplingParams()
        prompt = prompt_token_ids(prompt_tokens, self.tokenizer)
        max_new = self.check_request(request_id, prompt, params, prefilled_import=prefilled_import)
        seed = params.seed if params.seed is not None else (self.seed * _SEED_MIX + self._num_added) % 2**63
        self._num_added += 1
        generator = None if params.greedy else make_generator(seed, self.runner.device)
        request = EngineRequest(
            request_id, prompt, params, max_new, generator, prefilled_import=prefilled_import, text=self._text(params)
        )
        self._requests[request_id] = request
        self.scheduler.enqueue(request)

    def check_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, prefilled_import: bool = False
    ) -> int:
        """Raise the typed error of a request this engine can never serve; else return its
        generation budget (``max_tokens``, or what the sequence length leaves)."""
        if request_id in self._requests:
            raise DuplicateRequestIdError(request_id=request_id)
        if params.stop and self.tokenizer is None:
            raise StopSequencesNeedTokenizerError(stop=list(params.stop))
        vocab = self.model.vocab_size
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise InvalidPromptError(reason="empty prompt" if not prompt else "token id out of range", vocab_size=vocab)
        room = self.max_sequence_length - len(prompt)
        if len(prompt) <= self.max_sequence_length and (room < 1 or (params.max_tokens or 0) > room):
            raise MaxSequenceLengthOverflowError(
                prompt_length=len(prompt),
                max_tokens=params.max_tokens or 1,
                max_sequence_length=self.max_sequence_length,
            )
        max_new = params.max_tokens or room
        # The last generated token's KV is never computed.
        self.context.check_admission(len(prompt), max_new - 1, prefilled_import=prefilled_import)
        return max_new

    def _text(self, params: SamplingParams) -> TextStream | None:
        return TextStream(self.tokenizer, params.stop) if self.tokenizer is not None else None

    def detach_for_handoff(self, request_id: str) -> tuple[EngineRequest, RequestState]:
        """Hand an unfinished request over to another engine: the engine forgets it (no
        output), and its context storage (KV blocks, Mamba slot) stays held for the handoff
        until the caller gives it back with ``context.release_detached``."""
        request = self._requests.pop(request_id)
        self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED
        return request, self.context.detach_request(request_id)

    def admit_imported(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        sampling_params: SamplingParams,
        *,
        generated_tokens: Sequence[int],
        generated_log_probs: Sequence[float],
        prompt_log_probs: Sequence[float] | None = None,
        generator_state: torch.Tensor | None = None,
    ) -> None:
        """Enter a request straight into decode whose prompt KV (and Mamba state) a handoff
        already put into this context (``context.import_request``): its tokens so far are
        ``generated_tokens`` (not reported yet: the next output starts with them and their text,
        as one engine's would); ``generator_state`` continues the sampler of the engine that
        produced them. Checked like :meth:`add_request` except the per-step prompt limit."""
        prompt = [int(t) for t in prompt_tokens]
        max_new = self.check_request(request_id, prompt, sampling_params, prefilled_import=True)
        generator = None
        if not sampling_params.greedy:
            generator = make_generator(sampling_params.seed or 0, self.runner.device)
            if generator_state is not None:
                generator.set_state(generator_state)
        request = EngineRequest(
            request_id,
            prompt,
            sampling_params,
            max_new,
            generator,
            prefilled_import=True,
            status=RequestStatus.ACTIVE,
            prefill_target=len(prompt),
            generated_log_probs=list(generated_log_probs),
            prompt_log_probs=list(prompt_log_probs or []),
            text=self._text(sampling_params),
        )
        self._requests[request_id] = request
        self.scheduler.admitted.append(request)
        # The same finish rules as for tokens sampled here (the source engine applied them too).
        reason = self._accept(request, [int(t) for t in generated_tokens])
        if reason is not None:
            request.finish_reason = reason
            self.context.release_request(request_id)
            self._finish(request)

    def abort(self, request_id: str) -> None:
        """Finish a request in any state with ``finish_reason="abort"`` (reported by the next
        ``step``); unknown or finished ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.status is not RequestStatus.WAITING:
            self.context.release_request(request_id)
        request.finish_reason = "abort"
        self._finish(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._pending)

    def pause(self) -> None:
        """Stop stepping (requests are kept; ``step`` only reports pending outputs)."""
        self._stepping_paused = True

    def resume(self) -> None:
        self._stepping_paused = False

    def step(self) -> list[RequestOutput]:
        """One schedule / forward / sample / bookkeeping step; returns the partial outputs of
        requests that produced tokens and every terminal output."""
        outputs, self._pending = self._pending, []
        if self._stepping_paused or not self.scheduler.has_requests():
            return outputs
        started = time.perf_counter()
        scheduled, events = self.scheduler.schedule()
        self._stats["pauses"] += events.pauses
        self._stats["evictions"] += events.evictions
        self._stats["prefix_cache_hits"] += events.prefix_cache_hit_blocks
        if not scheduled:
            return outputs
        batch = self.context.build_step(
            [(s.request.request_id, s.num_tokens) for s in scheduled], pad_to_tokens=self.pad_steps_to
        )
        bookkeeping = time.perf_counter() - started
        with kernels.batch_invariant(self.batch_invariant):
            result = self.runner.forward(self.context, batch)
        self.context.commit_step()
        decisions = self._decide(scheduled, batch, *result) if result is not None else None
        decisions = self._share(scheduled, decisions)
        started = time.perf_counter()
        outputs += self._apply(scheduled, decisions)
        self._stats["steps"] += 1
        self.step_bookkeeping_s.append(bookkeeping + time.perf_counter() - started)
        return outputs + self._pending_and_clear()

    # ---- decisions (last pipeline stage) ----------------------------------------------------
    def _decide(
        self, scheduled: list[ScheduledRequest], batch: StepBatch, logits: torch.Tensor, hidden: torch.Tensor
    ) -> list[Decision]:
        starts, offsets = batch.cu_query_lengths.tolist(), batch.kv_offsets.tolist()
        decisions = [Decision() for _ in scheduled]
        verifying = []  # (index, first sampling row, drafts)
        for index, (entry, start, offset) in enumerate(zip(scheduled, starts[:-1], offsets, strict=True)):
            request, state = entry.request, self.context.request(entry.request.request_id)
            if request.wants_prompt_log_probs:
                decisions[index].prompt_log_probs = self._prompt_log_probs(
                    request, logits, start, offset, entry.num_tokens
                )
            if offset + entry.num_tokens == len(state.tokens):
                drafts = state.tokens[len(state.tokens) - state.num_draft_tokens :]
                verifying.append((index, start + entry.num_tokens - 1 - len(drafts), drafts))
        first_rows = {index: row for index, row, _ in verifying}
        depth = 0
        while verifying:
            rows = torch.tensor([row + depth for _, row, _ in verifying], device=logits.device)
            requests = [scheduled[index].request for index, _, _ in verifying]
            tokens = sample(logits[rows], [r.sampling_params for r in requests], [r.generator for r in requests])
            log_probs = token_logprobs(logits[rows], tokens).tolist()
            still = []
            for (index, row, drafts), request, token, log_prob in zip(
                verifying, requests, tokens.tolist(), log_probs, strict=True
            ):
                decision = decisions[index]
                decision.tokens.append(token)
                decision.log_probs.append(log_prob)
                # A draft after EOS is not verified (nothing follows EOS). Tokens after a stop
                # sequence may be: every stage drops them when it finds the stop (_accept).
                if not self._is_eos(request, token) and depth < len(drafts) and token == drafts[depth]:
                    decision.accepted_drafts += 1
                    still.append((index, row, drafts))
            verifying = still
            depth += 1
        if self.drafter is not None:
            self._propose_drafts(scheduled, decisions, first_rows, batch, hidden)
        return decisions

    def _share(self, scheduled: list[ScheduledRequest], decisions: list[Decision] | None) -> list[Decision]:
        """The last stage's decisions on every stage: one int64 tensor of a layout every stage
        knows from the schedule."""
        if self.runner.pp_size == 1:
            return decisions
        layout = DecisionLayout(
            max_tokens=1 + self.num_speculative_tokens,
            max_next_drafts=self.num_speculative_tokens,
            prompt_log_prob_capacity=tuple(
                entry.num_tokens if entry.request.wants_prompt_log_probs else 0 for entry in scheduled
            ),
        )
        shared = self.runner.share_from_last_stage(layout.pack(decisions) if decisions is not None else layout.empty())
        return decisions if decisions is not None else layout.unpack(shared)

    def _prompt_log_probs(
        self, request: EngineRequest, logits, start: int, offset: int, num_tokens: int
    ) -> list[float]:
        # Row of position p predicts prompt token p + 1; record each once (not again after eviction).
        first = max(offset, len(request.prompt_log_probs))
        last = min(offset + num_tokens, len(request.prompt_tokens) - 1)
        if last <= first:
            return []
        rows = torch.arange(start + first - offset, start + last - offset, device=logits.device)
        targets = torch.tensor(request.prompt_tokens[first + 1 : last + 1], device=logits.device)
        return token_logprobs(logits[rows], targets).tolist()

    def _is_eos(self, request: EngineRequest, token: int) -> bool:
        return token == self.eos_token_id and not request.sampling_params.ignore_eos

    def _propose_drafts(
        self, scheduled, decisions, first_rows: dict[int, int], batch: StepBatch, hidden: torch.Tensor
    ) -> None:
        wanted = []  # (decision, row its last token was sampled from, number of drafts)
        for index, first_row in first_rows.items():
            decision = decisions[index]
            request = scheduled[index].request
            count = min(self.num_speculative_tokens, request.remaining_budget - len(decision.tokens) - 1)
            if count > 0 and not self._is_eos(request, decision.tokens[-1]):
                wanted.append((decision, first_row + len(decision.tokens) - 1, count))
        if not wanted:
            return
        rows = torch.tensor([row for _, row, _ in wanted], device=hidden.device)
        tokens = torch.tensor([d.tokens[-1] for d, _, _ in wanted], device=hidden.device)
        drafts = self.drafter.propose(hidden[rows], tokens, batch.positions[rows], max(c for _, _, c in wanted))
        for (decision, _, count), row_drafts in zip(wanted, drafts.tolist(), strict=True):
            decision.next_drafts = row_drafts[:count]

    # ---- bookkeeping (every stage) ----------------------------------------------------------
    def _apply(self, scheduled: list[ScheduledRequest], decisions: list[Decision]) -> list[RequestOutput]:
        outputs = []
        for entry, decision in zip(scheduled, decisions, strict=True):
            request = entry.request
            state = self.context.request(request.request_id)
            if state.num_computed_tokens - entry.num_tokens < request.prefill_target:
                self._stats["prefill_tokens_computed"] += min(
                    entry.num_tokens, request.prefill_target - (state.num_computed_tokens - entry.num_tokens)
                )
            request.prompt_log_probs.extend(decision.prompt_log_probs)
            num_before = len(request.generated_tokens)
            reason = self._accept(request, decision.tokens)
            num_kept = len(request.generated_tokens) - num_before
            accepted = min(decision.accepted_drafts, max(num_kept - 1, 0))
            if state.num_draft_tokens:
                self._stats["drafts_accepted"] += accepted
                self._stats["drafts_rejected"] += state.num_draft_tokens - accepted
                self.context.resolve_draft_tokens(request.request_id, accepted)
            if not num_kept:
                continue
            request.generated_log_probs.extend(decision.log_probs[:num_kept])
            self._stats["tokens_generated"] += num_kept
            self.context.append_tokens(request.request_id, decision.tokens[accepted:num_kept])
            if reason is not None:
                request.finish_reason = reason
                self.context.release_request(request.request_id)
                self._finish(request)
            else:
                request.drafts = decision.next_drafts
                outputs.append(request.take_output())
        return outputs

    def _accept(self, request: EngineRequest, tokens: list[int]) -> str | None:
        """Append ``tokens`` to ``request`` in order, through the first one that ends it, and
        return that finish reason (or None). Every stage runs this on the same shared tokens, so
        all agree on where each request ends."""
        for token in tokens:
            request.generated_tokens.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                return reason
        return None

    def _finish_reason(self, request: EngineRequest, token: int) -> str | None:
        text = request.text
        if self._is_eos(request, token):  # EOS has no text; what was held back is settled
            if text is not None:
                text.finish()
            return "stop"
        if text is not None and text.add_token(token):
            return "stop"
        if len(request.generated_tokens) >= request.max_new_tokens:
            return "stop" if text is not None and text.finish() else "length"
        return None

    def _finish(self, request: EngineRequest) -> None:
        request.status = RequestStatus.FINISHED
        self.scheduler.remove(request)
        del self._requests[request.request_id]
        self._pending.append(request.take_output(finished=True))

    def _pending_and_clear(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        return outputs
