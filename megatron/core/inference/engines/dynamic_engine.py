"""The dynamic inference engine: continuous batching over a paged KV cache.

``add_request`` validates and queues; each ``step`` schedules (see :mod:`scheduler`: growth,
pausing, eviction, admission, chunked prefill), runs the model over the packed step
(:mod:`model_runner`, any TP/PP layout; decode and mixed steps from CUDA graphs, see
:mod:`cuda_graphs`), samples on the last pipeline stage, on the device (logit bias, min_tokens,
presence / frequency / repetition penalties over device token counts, see
:mod:`~megatron.core.inference.sampling_controls`; greedy, temperature, min-p, top-k, top-p,
counter-based per-request seeds; log-probs and top-k log-probs; speculative drafts verified, see
:mod:`speculative`), shares those decisions with every stage as one tensor (see
:mod:`step_decisions`), and returns streaming outputs. Every stage then derives each request's
finish from the shared tokens by the same code: EOS or a stop token id, the length budget, or a
stop sequence completed in the request's text (none before ``min_tokens``; each request's
:class:`~megatron.core.inference.text_stream.TextStream`
detokenizes incrementally on every stage; outputs carry its text deltas). Every rank of a
model-parallel group runs its own engine with the same calls in the same order; all stay in
lockstep.

One step, in this order::

    schedule N+1 -> build its inputs -> launch its forward (device) -> commit it (host books)
    -> read back the decisions of step N, apply them (tokens, finishes, outputs)
    -> sample N+1 (device; logits processors, then grammar bitmasks first) and start reading its decisions back

With overlapped steps (``overlap_steps``, the default on one CUDA pipeline stage without
speculation) step N is the previous call's, so the host prepares N+1 while the device still
runs N: each request N is sampling is scheduled into N+1 with a *pending* token (read on the
device from N's sampled tokens; never hashed or cached before it is known; its new page, if
any, is a private page of the ``async_preparation`` path), except requests N ends by length.
A request N ends otherwise (EOS, a stop sequence, an abort) has its storage released when its
decision is applied, and its row of N+1 is not sampled; a row whose token is no longer the
request's next one (it was evicted and re-admitted meanwhile) is not sampled either. Sampling
of N+1 comes after N is applied, so per-request logits processors see every token so far, and the
grammar bitmasks of N+1 (:mod:`~megatron.core.inference.structured_output`) are filled on the host
from every accepted token while the device runs N+1's forward. When the pool is short of blocks
(a request is paused, or the decoding requests' next tokens need more fresh blocks than are free,
:meth:`Scheduler.short_of_blocks`), N is finished before N+1 is scheduled: the requests N ends give
their blocks back first, so overlapped steps do not pause or evict requests that steps run one by
one would keep running (before this, a tight pool paused and evicted half as often again and
recomputed nearly twice the prefill tokens).
Without overlap, N is the step just launched, and the order is the plain one.

Steps are padded to step buckets (``batch_invariant``, the default; see :mod:`step_buckets`):
with the reference kernels (row-invariant at the bucket sizes kept), a request's tokens and
log-probs do not depend on what else ran with it: a tight pool (pauses, evictions), chunked
prefill, prefix caching, speculation, overlapped steps and CUDA graphs give exactly the outputs
of a roomy pool.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron.core.inference import kernels
from megatron.core.inference.contexts.capacity import CapacityConfig
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, RequestState, StepBatch
from megatron.core.inference.engines.cuda_graphs import StepGraphs, graph_blocker, mixed_step_blocker
from megatron.core.inference.engines.errors import (
    EngineConfigError,
    InvalidPromptError,
    LogitBiasTokenOutOfRangeError,
    MaxSequenceLengthOverflowError,
    StopSequencesNeedTokenizerError,
    StopTokenIdsOutOfRangeError,
)
from megatron.core.inference.engines.requests import EngineRequest, RequestOutput, RequestStatus
from megatron.core.inference.engines.scheduler import ScheduledRequest, Scheduler
from megatron.core.inference.engines.speculative import MTPDrafter
from megatron.core.inference.engines.step_buckets import StepBuckets, candidate_buckets, row_invariant_buckets
from megatron.core.inference.engines.step_decisions import Decision, DecisionLayout
from megatron.core.inference.errors import DuplicateRequestIdError
from megatron.core.inference.host_copies import DeviceToHost, to_device
from megatron.core.inference.model_runner import ModelRunner, model_is_hybrid, stage_cache_spec
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import LogitsProcessor, SamplingParams, SamplingRows, make_generator, sample
from megatron.core.inference.sampling_controls import ControlRow, TokenCounts, apply_sampling_controls
from megatron.core.inference.structured_output.batch import StructuredOutputs
from megatron.core.inference.text_stream import TextStream
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.attention import default_softmax_scale

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class _Step:
    """A launched step: its schedule and batch facts, its outputs on the device, and (once
    sampled) the rows it samples and the read-back of its decisions."""

    scheduled: list[ScheduledRequest]
    starts: list[int]  # first packed row of each scheduled request
    offsets: list[int]  # tokens cached before the step, per scheduled request
    logits: torch.Tensor | None  # [T, V] fp32, or its first len(logit_rows) rows are those rows' (last stage)
    hidden: torch.Tensor | None  # [T, h] (last stage)
    positions: torch.Tensor | None  # [T] (for the MTP drafter)
    log_probs: torch.Tensor | None  # log-softmax of every row of ``logits`` (graphs), or None
    # The packed rows whose logits ``logits`` holds, in its row order; None: every packed row.
    logit_rows: list[int] | None = None
    # Filled by _sample: per scheduled request, its rows among the sampled ones, its prompt
    # log-prob count, its top log-prob width, and the draft tokens its rows verify.
    sample_rows: list[range] = field(default_factory=list)
    prompt_counts: list[int] = field(default_factory=list)
    top_widths: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    sampled_tokens: torch.Tensor | None = None  # [rows] on the device: the next step's pending tokens
    readback: DeviceToHost | None = None


@dataclass(frozen=True)
class _RowPlan:
    """The packed rows one scheduled request's step reads logits from (see
    ``DynamicInferenceEngine._row_plan``): ``sampled`` (one per speculative depth) and ``prompt``
    (prompt log-probs, of ``prompt_targets``), and the ``drafts`` its sampled rows verify."""

    sampled: range
    prompt: range
    prompt_targets: list[int]
    drafts: list[int]


def _starts_and_offsets(scheduled: list[ScheduledRequest], batch: StepBatch) -> tuple[list[int], list[int]]:
    """Per scheduled request: its first packed row and the tokens cached before the step."""
    starts = [0, *itertools.accumulate(batch.host_query_lengths[: len(scheduled) - 1])]
    return starts, list(batch.host_kv_offsets[: len(scheduled)])


def _last_rows(scheduled: list[ScheduledRequest], starts: list[int]) -> list[int]:
    """The packed row of each scheduled request's last token in the step."""
    return [start + entry.num_tokens - 1 for entry, start in zip(scheduled, starts, strict=True)]


def _automatic_long_prefill_threshold(model, batch_invariant: bool, max_tokens_per_step: int, device) -> int:
    """The default ``long_prefill_token_threshold``: a hybrid model's batch-invariant prefill on
    the torch Mamba path advances its recurrence one position after another, so a step costs its
    longest chunk; chunks of an eighth of the step's budget let several prompts share those
    positions (a 256-token CPU step of one prompt ran 256 of them, of eight prompts 32)."""
    token_by_token = model_is_hybrid(model) and batch_invariant and kernels.kernel_backend(device) != "triton"
    return max(max_tokens_per_step // 8, 16) if token_by_token else 0


class DynamicInferenceEngine:
    """Serves generation requests on one model replica (one model-parallel group).

    Args:
        model: this rank's GPTModel / HybridModel stage (put in eval mode).
        tokenizer: optional; gives the EOS id, the outputs' text and stop sequences (requests with
            ``stop`` need it).
        block_size: tokens per KV block.
        num_blocks / buffer_size_bytes / max_requests: cache capacity (see ``CapacityConfig``).
        max_tokens_per_step: most tokens one step processes.
        max_sequence_length: longest prompt + generation (default: the model's).
        enable_prefix_caching / enable_chunked_prefill: features.
        long_prefill_token_threshold: with chunked prefill, the most tokens of one prompt a step
            takes (vLLM's option), so a step's budget goes to several prompts: 0 off, else >= 2.
            None (default): 0, except where a step's cost is its longest chunk rather than its
            token count, a hybrid model's batch-invariant prefill on the torch Mamba path (one
            position after another): there ``max(max_tokens_per_step // 8, 16)``.
        paused_block_budget: blocks paused requests may hold before the newest is evicted
            (default: half the pool).
        num_speculative_tokens: MTP drafts per decode step (0: off).
        eos_token_id: stops generation unless ``ignore_eos`` (default: the tokenizer's).
        seed: base of the generators of requests without a seed.
        batch_invariant: pad every step to a step bucket at which the linear layers and the
            Mamba decode steps were checked row invariant (see :mod:`step_buckets`), so that
            outputs do not depend on batch composition; False runs eager steps at their real
            size (outputs may then differ in the last bits).
        enable_cuda_graphs: decode-only steps replay CUDA graphs captured per bucket, and mixed
            (prefill) steps that sample at most each request's last row one per token bucket
            (default: True on CUDA when the stage can be captured; on a CPU device True runs the
            same static-buffer steps eagerly). ``--no-cuda-graphs`` / ``--cuda-graphs`` on
            ``megatron-serve`` and the offline example set it (see :func:`add_cuda_graph_flag`).
        overlap_steps: prepare step N+1 on the host while the device runs step N (see module
            doc; default: on CUDA with one pipeline stage and no speculation).
        logits_processors: per-request logits changes applied on the device before sampling
            (see :class:`~megatron.core.inference.sampling.LogitsProcessor`).
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
        long_prefill_token_threshold: int | None = None,
        paused_block_budget: int | None = None,
        num_speculative_tokens: int = 0,
        eos_token_id: int | None = None,
        seed: int = 0,
        batch_invariant: bool = True,
        enable_cuda_graphs: bool | None = None,
        overlap_steps: bool | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        pg_collection: ProcessGroupCollection | None = None,
    ):
        pg = resolve_pg_collection(pg_collection)
        if model.config.sequence_parallel:
            raise EngineConfigError(
                "inference runs without sequence parallelism; build the model with sequence_parallel=False"
            )
        cp_size = max(model.config.context_parallel_size, pg.size("cp") if pg.has("cp") else 1)
        if cp_size > 1:
            raise EngineConfigError(
                f"inference runs at context parallel size 1, got {cp_size}; build the model and its process groups "
                "with context_parallel_size=1 (a checkpoint trained with CP loads at any CP)"
            )
        if long_prefill_token_threshold is not None and (
            long_prefill_token_threshold < 0 or long_prefill_token_threshold == 1
        ):
            raise EngineConfigError(
                f"long_prefill_token_threshold must be 0 (off) or >= 2, got {long_prefill_token_threshold}"
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
            softmax_scale=default_softmax_scale(model.config),
        )
        pool_blocks = self.context.capacity.num_blocks
        budget = pool_blocks // 2 if paused_block_budget is None else paused_block_budget
        if budget < 0:
            raise EngineConfigError(f"paused_block_budget must be >= 0, got {paused_block_budget}")
        if long_prefill_token_threshold is None:
            long_prefill_token_threshold = _automatic_long_prefill_threshold(
                model, batch_invariant, max_tokens_per_step, self.runner.device
            )
        self.scheduler = Scheduler(
            self.context,
            max_tokens_per_step=max_tokens_per_step,
            enable_chunked_prefill=enable_chunked_prefill,
            paused_block_budget=budget,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
        self.drafter = MTPDrafter(self.runner, num_speculative_tokens) if num_speculative_tokens else None
        self.num_speculative_tokens = num_speculative_tokens
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos", None)
        self.seed = seed
        self.logits_processors = list(logits_processors)
        self.token_counts = TokenCounts(self.context.capacity.max_requests, model.vocab_size, self.runner.device)
        self.structured_outputs = StructuredOutputs(tokenizer, model.vocab_size, self.eos_token_id)
        candidates = candidate_buckets(max_tokens_per_step, self.context.capacity.max_requests)
        # Eager steps pad to these (None: unpadded); graphs always run at a bucket.
        with kernels.batch_invariant(batch_invariant):  # checked with the GEMMs the mode runs
            self.buckets = StepBuckets(row_invariant_buckets(model, candidates, pg)) if batch_invariant else None
        self.graphs = self._step_graphs(enable_cuda_graphs, self.buckets or StepBuckets(candidates))
        self.overlap_steps = self._overlap(overlap_steps)
        self._requests: dict[str, EngineRequest] = {}
        self._pending: list[RequestOutput] = []
        self._in_flight: _Step | None = None
        self._host_s = 0.0
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
            graph_steps=0,
            graph_mixed_steps=0,
        )

    def _step_graphs(self, enable: bool | None, buckets: StepBuckets) -> StepGraphs | None:
        blocker = graph_blocker(self.runner, self.context)
        self.cuda_graphs_blocker = blocker
        self.mixed_step_graphs_blocker = mixed_step_blocker(self.context, self.batch_invariant)
        on_cpu = self.runner.device.type == "cpu"
        if enable is False or (enable is None and blocker is not None):
            return None
        if blocker is not None and not on_cpu:
            raise EngineConfigError(f"enable_cuda_graphs=True, but {blocker}")
        graphs = StepGraphs(
            self.runner,
            self.context,
            buckets.sizes,
            capture=not on_cpu,
            mixed_steps=self.mixed_step_graphs_blocker is None,
        )
        with kernels.batch_invariant(self.batch_invariant):
            graphs.capture()
        return graphs

    def _overlap(self, overlap: bool | None) -> bool:
        reasons = [
            reason
            for reason, applies in (
                ("pipeline parallelism (every stage needs the previous tokens first)", self.runner.pp_size > 1),
                ("speculative decoding (drafts depend on the previous step's tokens)", self.num_speculative_tokens),
            )
            if applies
        ]
        if overlap is None:
            return self.runner.device.type == "cuda" and not reasons
        if overlap and reasons:
            raise EngineConfigError(f"overlap_steps=True does not work with {reasons[0]}; use overlap_steps=False")
        return overlap

    def set_overlap_steps(self, overlap: bool) -> None:
        """Switch overlapped steps on or off between steps (a handoff prefill side needs them
        off: a pinned request's state must stop at its prompt). Finishes any step in flight."""
        if overlap:
            self._overlap(True)  # raises where overlap cannot work
        self._pending += self._finish_in_flight()
        self.overlap_steps = overlap

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
        generator = None if params.greedy else make_generator(seed)
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
        self.structured_outputs.check(params)
        vocab = self.model.vocab_size
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise InvalidPromptError(reason="empty prompt" if not prompt else "token id out of range", vocab_size=vocab)
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            raise LogitBiasTokenOutOfRangeError(token_ids=outside[:5], vocab_size=vocab)
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise StopTokenIdsOutOfRangeError(token_ids=outside[:5], vocab_size=vocab)
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
        self.token_counts.release(request_id)
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
        generated_top_log_probs: Sequence[Sequence[tuple[int, float]]] | None = None,
    ) -> None:
        """Enter a request straight into decode whose prompt KV (and Mamba state) a handoff
        already put into this context (``context.import_request``): its tokens so far are
        ``generated_tokens`` (not reported yet: the next output starts with them and their text,
        as one engine's would), with their log-probs (and top log-probs, when the request asks
        for them); ``generator_state`` continues the sampler of the engine that produced them.
        Checked like :meth:`add_request` except the per-step prompt limit."""
        prompt = [int(t) for t in prompt_tokens]
        max_new = self.check_request(request_id, prompt, sampling_params, prefilled_import=True)
        generator = None
        if not sampling_params.greedy:
            generator = make_generator(sampling_params.seed or 0)
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
            generated_top_log_probs=[[(int(t), float(lp)) for t, lp in row] for row in generated_top_log_probs or []],
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
        return bool(self._requests or self._pending or self._in_flight)

    def pause(self) -> None:
        """Stop stepping (requests are kept; ``step`` only reports pending outputs)."""
        self._stepping_paused = True

    def resume(self) -> None:
        self._stepping_paused = False

    def step(self) -> list[RequestOutput]:
        """One step (see module doc); returns the partial outputs of requests that produced
        tokens and every terminal output. With overlapped steps a step's tokens are reported by
        the next call (a call with nothing new to launch just finishes the step in flight)."""
        outputs, self._pending = self._pending, []
        self._host_s = 0.0
        completed = False
        if self._in_flight is not None and self.scheduler.short_of_blocks(self._in_flight.scheduled):
            # Short of blocks: finish the step in flight first, so that the requests it ends give
            # their blocks back before the schedule, which would otherwise pause or evict others.
            outputs += self._finish_in_flight()
            completed = True
        launched = None
        if not self._stepping_paused and self.scheduler.has_requests():
            launched = self._launch()
        completed = completed or self._in_flight is not None or (launched is not None and not self.overlap_steps)
        outputs += self._finish_in_flight()
        if launched is not None:
            self._sample(launched)
            if self.overlap_steps:
                self._in_flight = launched
            else:
                outputs += self._complete(launched)
        if completed:
            self.step_bookkeeping_s.append(self._host_s)
        return outputs + self._pending_and_clear()

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Complete the step in flight, if any; its outputs (none without one)."""
        if self._in_flight is None:
            return []
        outputs = self._complete(self._in_flight)
        self._in_flight = None
        return outputs

    # ---- launch (every stage) ---------------------------------------------------------------
    def _launch(self) -> _Step | None:
        """Schedule the next step (pending tokens for the step in flight), build its inputs, run
        its forward (queued on the device) and commit it; None when nothing can run."""
        started = time.perf_counter()
        in_flight = self._in_flight
        if in_flight is not None:
            self._add_pending_tokens(in_flight)
        scheduled, events = self.scheduler.schedule()
        self._stats["pauses"] += events.pauses
        self._stats["evictions"] += events.evictions
        self._stats["prefix_cache_hits"] += events.prefix_cache_hit_blocks
        if not scheduled:
            return None
        schedule = [(s.request.request_id, s.num_tokens) for s in scheduled]
        num_tokens = sum(s.num_tokens for s in scheduled)
        pending = in_flight.sampled_tokens if in_flight is not None else None
        row_buckets = self.buckets.sizes if self.buckets is not None else ()
        key = None
        if self.graphs is not None:
            key = self.graphs.key_for(len(scheduled), num_tokens, self._one_logit_row_per_request(scheduled))
        if key is not None:
            batch = self.context.build_step(
                schedule,
                pad_to_tokens=key.tokens,
                pad_to_requests=key.rows,
                padding_request_tokens=int(key.decode),
                pending_tokens=pending,
                row_buckets=row_buckets,
            )
            starts, offsets = _starts_and_offsets(scheduled, batch)
            self._host_s += time.perf_counter() - started
            with kernels.batch_invariant(self.batch_invariant):
                logits, hidden, log_probs = self.graphs.run(key, batch)
            # A decode step: every row samples; a mixed one: the logits hold each request's last row.
            logit_rows = None if key.decode else _last_rows(scheduled, starts)
            self._stats["graph_steps"] += 1
            self._stats["graph_mixed_steps"] += not key.decode
        else:
            pad = self.buckets.pad(num_tokens) if self.buckets is not None else None
            batch = self.context.build_step(
                schedule, pad_to_tokens=pad, pending_tokens=pending, row_buckets=row_buckets
            )
            starts, offsets = _starts_and_offsets(scheduled, batch)
            logit_rows = self._logit_rows(scheduled, starts, offsets) if self.runner.is_last_stage else None
            rows_tensor = (
                None
                if logit_rows is None
                else to_device(torch.tensor(logit_rows, dtype=torch.long), self.runner.device)
            )
            self._host_s += time.perf_counter() - started
            with kernels.batch_invariant(self.batch_invariant):
                result = self.runner.forward(self.context, batch, logit_rows=rows_tensor)
            logits, hidden = result if result is not None else (None, None)
            log_probs = None
        self._stats["prefill_tokens_computed"] += sum(
            max(min(entry.num_tokens, entry.request.prefill_target - offset), 0)
            for entry, offset in zip(scheduled, offsets, strict=True)
        )
        self.context.commit_step()
        self._stats["steps"] += 1
        return _Step(scheduled, starts, offsets, logits, hidden, batch.positions, log_probs, logit_rows)

    def _one_logit_row_per_request(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether sampling reads at most each request's last row of the step (no speculation,
        no prompt log-probs)."""
        return not self.num_speculative_tokens and not any(e.request.wants_prompt_log_probs for e in scheduled)

    def _logit_rows(self, scheduled: list[ScheduledRequest], starts: list[int], offsets: list[int]) -> list[int]:
        """The packed rows of an eager step whose logits sampling can read (see :meth:`_row_plan`):
        only those are projected onto the vocabulary, not every prefill row. Without speculation
        or prompt log-probs, each request's last row (one per request, so that no state is read;
        a chunk that does not end its prompt adds one row never read)."""
        if self._one_logit_row_per_request(scheduled):
            return _last_rows(scheduled, starts)
        rows = []
        for entry, start, offset in zip(scheduled, starts, offsets, strict=True):
            plan = self._row_plan(entry, start, offset)
            if plan is not None:
                rows += plan.prompt
                rows += plan.sampled
        return sorted(set(rows))

    def _row_plan(self, entry: ScheduledRequest, start: int, offset: int) -> _RowPlan | None:
        """Where a scheduled request's step reads logits (None: the request is gone): its
        prompt log-prob rows (each prompt position once, not again after an eviction) and, when
        the step ends at its newest token, one sampled row per speculative depth."""
        request = entry.request
        state = self.context.find(request.request_id) if request.status is not RequestStatus.FINISHED else None
        if state is None:
            return None
        prompt, targets = range(0), []
        if request.wants_prompt_log_probs:
            # Row of position p predicts prompt token p + 1.
            first = max(offset, len(request.prompt_log_probs))
            last = max(min(offset + entry.num_tokens, len(request.prompt_tokens) - 1), first)
            prompt, targets = (
                range(start + first - offset, start + last - offset),
                request.prompt_tokens[first + 1 : last + 1],
            )
        end = offset + entry.num_tokens
        if end != len(state.tokens):
            return _RowPlan(range(0), prompt, targets, [])
        num_drafts = state.num_draft_tokens
        base = start + entry.num_tokens - 1 - num_drafts
        drafts = state.tokens[end - num_drafts :] if num_drafts else []
        return _RowPlan(range(base, base + num_drafts + 1), prompt, targets, drafts)

    def _add_pending_tokens(self, in_flight: _Step) -> None:
        """Give every request the step in flight samples its next token as a pending one (read on
        the device from the step's sampled tokens), unless that token ends it by length."""
        for entry, rows in zip(in_flight.scheduled, in_flight.sample_rows, strict=True):
            request = entry.request
            # (Requests of the step in flight are still active unless aborted or handed off.)
            if rows and request.status is not RequestStatus.FINISHED and request.remaining_budget > 1:
                self.context.append_pending_token(request.request_id, rows.start)

    # ---- decisions (last pipeline stage) ----------------------------------------------------
    def _sample(self, step: _Step) -> None:
        """Pick the rows the step samples (every request whose step ends at its newest token;
        one row per speculative depth), and queue on the device: their log-probs (and top-k),
        the logits processors, sampling, the prompt log-probs asked for, and the read-back of
        all of it in one copy. Every stage records which requests sample (no device work)."""
        rows, requests, draws, prompt_rows, prompt_targets, drafts = [], [], [], [], [], []
        draft_prefixes = []  # per row: the drafts before its depth
        for entry, start, offset in zip(step.scheduled, step.starts, step.offsets, strict=True):
            request = entry.request
            first_row = len(rows)
            plan = self._row_plan(entry, start, offset)
            if plan is not None:
                prompt_rows += plan.prompt
                prompt_targets += plan.prompt_targets
                generated = len(request.generated_tokens)
                for depth, row in enumerate(plan.sampled):
                    rows.append(row)
                    requests.append(request)
                    draws.append(generated + depth)
                    drafts.append(plan.drafts)
                    draft_prefixes.append(plan.drafts[:depth])
            step.sample_rows.append(range(first_row, len(rows)))
            step.prompt_counts.append(len(plan.prompt) if plan is not None else 0)
            step.top_widths.append(request.sampling_params.top_logprobs)
            step.drafts.append(plan.drafts if plan is not None else [])
        if not self.runner.is_last_stage or not (rows or prompt_rows):
            return
        if step.logit_rows is not None:  # packed rows -> rows of the step's logits
            position = {row: index for index, row in enumerate(step.logit_rows)}
            rows, prompt_rows = [position[row] for row in rows], [position[row] for row in prompt_rows]
        device = step.logits.device
        num_sampled, num_prompt = len(rows), len(prompt_rows)
        # Rows 0..n-1 (every request decoding, none finished): views, no index or gather; else
        # the sampled rows, the prompt log-prob rows and their targets as one host tensor, one copy.
        leading = not prompt_rows and rows[-1] == num_sampled - 1
        indices = None if leading else to_device(torch.tensor(rows + prompt_rows + prompt_targets), device)
        parts = []
        if rows:
            # The sampled rows' logits (the engine's: the controls and processors below change them in place).
            logits = self._rows(step.logits, num_sampled, indices)
            if step.log_probs is None:
                log_probs = kernels.log_softmax(logits)  # per row (Triton on CUDA, torch's on CPU)
            else:  # the same kernel's rows, computed by the step's graph before the changes
                log_probs = self._rows(step.log_probs, num_sampled, indices)
            self._apply_sampling_controls(logits, requests, draft_prefixes)
            if self.logits_processors:
                request_ids = [r.request_id for r in requests]
                for processor in self.logits_processors:
                    processor(logits, request_ids)
            self.structured_outputs.mask_logits(logits, requests, drafts)
            params = [r.sampling_params for r in requests]
            tokens = sample(logits, SamplingRows.build(params, [r.generator for r in requests], draws, device))
            step.sampled_tokens = tokens
            parts += [tokens.double(), log_probs.gather(1, tokens[:, None])[:, 0].double()]
            width = max(step.top_widths)
            if width:
                top_values, top_ids = log_probs.topk(width, dim=-1)
                parts += [top_ids.double().flatten(), top_values.double().flatten()]
        if prompt_rows:
            prompt_logits = step.logits.index_select(0, indices[num_sampled : num_sampled + num_prompt])
            targets = indices[num_sampled + num_prompt :]
            parts.append(kernels.log_softmax(prompt_logits).gather(1, targets[:, None])[:, 0].double())
        step.readback = DeviceToHost(torch.cat(parts))

    @staticmethod
    def _rows(values: torch.Tensor, count: int, indices: torch.Tensor | None) -> torch.Tensor:
        """Rows ``indices[:count]`` of ``values``; the first ``count`` rows (a view) when None."""
        return values[:count] if indices is None else values.index_select(0, indices[:count])

    def _apply_sampling_controls(
        self, logits: torch.Tensor, requests: list[EngineRequest], drafts: list[list[int]]
    ) -> None:
        """Logit bias, min_tokens and penalties of the sampled rows (see :mod:`sampling_controls`)."""
        if not any(r.sampling_params.has_logit_controls for r in requests):
            return
        rows = [
            ControlRow(r.request_id, r.sampling_params, r.prompt_tokens, r.generated_tokens, row_drafts)
            for r, row_drafts in zip(requests, drafts, strict=True)
        ]
        apply_sampling_controls(logits, rows, self.token_counts, self.eos_token_id)

    def _decisions(self, step: _Step) -> list[Decision]:
        """The step's decisions from its read-back (waits for it): tokens per request in depth
        order, accepted while they equal the drafts; then the next drafts (MTP)."""
        (values,) = step.readback.wait() if step.readback is not None else (torch.empty(0, dtype=torch.float64),)
        values = values.tolist()
        num_rows = step.sample_rows[-1].stop if step.sample_rows else 0
        width = max(step.top_widths, default=0) if num_rows else 0
        tokens = [int(t) for t in values[:num_rows]]
        log_probs = values[num_rows : 2 * num_rows]
        top_ids = values[2 * num_rows : 2 * num_rows + num_rows * width]
        top_values = values[2 * num_rows + num_rows * width : 2 * num_rows + 2 * num_rows * width]
        prompt = values[2 * num_rows + 2 * num_rows * width :]
        decisions, prompt_start = [], 0
        for entry, rows, prompt_count, top_width, drafts in zip(
            step.scheduled, step.sample_rows, step.prompt_counts, step.top_widths, step.drafts, strict=True
        ):
            decision = Decision(prompt_log_probs=prompt[prompt_start : prompt_start + prompt_count])
            prompt_start += prompt_count
            request = entry.request
            for depth, row in enumerate(rows):
                token = tokens[row]
                decision.tokens.append(token)
                decision.log_probs.append(log_probs[row])
                if top_width:
                    ids = top_ids[row * width : row * width + top_width]
                    lps = top_values[row * width : row * width + top_width]
                    decision.top_log_probs.append([(int(t), lp) for t, lp in zip(ids, lps, strict=True)])
                # A draft after EOS is not verified (nothing follows EOS). Tokens after a stop
                # sequence may be: every stage drops them when it finds the stop (_accept).
                if depth >= len(drafts) or self._is_eos(request, token) or token != drafts[depth]:
                    break
                decision.accepted_drafts += 1
            decisions.append(decision)
        if self.drafter is not None:
            self._propose_drafts(step, decisions)
        return decisions

    def _complete(self, step: _Step) -> list[RequestOutput]:
        """Read the step's decisions back (last stage), share them with every stage, apply them."""
        decisions = self._decisions(step) if self.runner.is_last_stage else None
        decisions = self._share(step, decisions)
        started = time.perf_counter()
        outputs = self._apply(step.scheduled, decisions)
        self._host_s += time.perf_counter() - started
        return outputs

    def _share(self, step: _Step, decisions: list[Decision] | None) -> list[Decision]:
        """The last stage's decisions on every stage: one int64 tensor of a layout every stage
        knows from the schedule."""
        if self.runner.pp_size == 1:
            return decisions
        layout = DecisionLayout(
            max_tokens=1 + self.num_speculative_tokens,
            max_next_drafts=self.num_speculative_tokens,
            prompt_log_prob_capacity=tuple(step.prompt_counts),
            top_log_prob_widths=tuple(step.top_widths),
        )
        shared = self.runner.share_from_last_stage(layout.pack(decisions) if decisions is not None else layout.empty())
        return decisions if decisions is not None else layout.unpack(shared)

    def _is_eos(self, request: EngineRequest, token: int) -> bool:
        """Whether ``token`` ends ``request`` as an end of sequence: EOS (unless ``ignore_eos``)
        or one of its ``stop_token_ids``."""
        params = request.sampling_params
        return (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids

    def _propose_drafts(self, step: _Step, decisions: list[Decision]) -> None:
        wanted = []  # (decision, row its last token was sampled from, number of drafts)
        for entry, start, rows, decision in zip(step.scheduled, step.starts, step.sample_rows, decisions, strict=True):
            if not rows:
                continue
            request = entry.request
            count = min(self.num_speculative_tokens, request.remaining_budget - len(decision.tokens) - 1)
            if count > 0 and not self._is_eos(request, decision.tokens[-1]):
                first_row = start + entry.num_tokens - len(rows)
                wanted.append((decision, first_row + len(decision.tokens) - 1, count))
        if not wanted:
            return
        device = step.hidden.device
        # Rows, then their last tokens: one host tensor, one copy.
        packed = to_device(torch.tensor([row for _, row, _ in wanted] + [d.tokens[-1] for d, _, _ in wanted]), device)
        rows, tokens = packed[: len(wanted)], packed[len(wanted) :]
        drafts = self.drafter.propose(step.hidden[rows], tokens, step.positions[rows], max(c for _, _, c in wanted))
        for (decision, _, count), row_drafts in zip(wanted, drafts.tolist(), strict=True):
            decision.next_drafts = row_drafts[:count]

    # ---- bookkeeping (every stage) ----------------------------------------------------------
    def _apply(self, scheduled: list[ScheduledRequest], decisions: list[Decision]) -> list[RequestOutput]:
        outputs, num_generated = [], 0
        context = self.context
        for entry, decision in zip(scheduled, decisions, strict=True):
            request = entry.request
            if request.status is RequestStatus.FINISHED:  # aborted or handed off since the step launched
                continue
            state = context.find(request.request_id)  # None: evicted since (waiting again)
            request.prompt_log_probs.extend(decision.prompt_log_probs)
            num_before = len(request.generated_tokens)
            reason = self._accept(request, decision.tokens)
            num_kept = len(request.generated_tokens) - num_before
            accepted = min(decision.accepted_drafts, max(num_kept - 1, 0))
            if state is not None and state.num_draft_tokens:
                self._stats["drafts_accepted"] += accepted
                self._stats["drafts_rejected"] += state.num_draft_tokens - accepted
                self.context.resolve_draft_tokens(request.request_id, accepted)
            if not num_kept:
                continue
            request.generated_log_probs.extend(decision.log_probs[:num_kept])
            if request.sampling_params.top_logprobs:
                request.generated_top_log_probs.extend(decision.top_log_probs[:num_kept])
            num_generated += num_kept
            if state is not None:
                new = decision.tokens[accepted:num_kept]
                if state.num_pending_tokens:  # the token a step already running continues from
                    context.resolve_pending_token(request.request_id, new.pop(0))
                if new:
                    context.append_tokens(request.request_id, new)
            if reason is not None:
                request.finish_reason = reason
                if state is not None:
                    context.release_request(request.request_id)
                self._finish(request)
            else:
                request.drafts = decision.next_drafts
                outputs.append(request.take_output())
        self._stats["tokens_generated"] += num_generated
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
        # Stop sequences end nothing before min_tokens (vLLM): their text is output then.
        if text is not None and text.add_token(
            token, can_stop=len(request.generated_tokens) >= request.sampling_params.min_tokens
        ):
            return "stop"
        if len(request.generated_tokens) >= request.max_new_tokens:
            return "stop" if text is not None and text.finish() else "length"
        return None

    def _finish(self, request: EngineRequest) -> None:
        request.status = RequestStatus.FINISHED
        self.token_counts.release(request.request_id)
        self.scheduler.remove(request)
        del self._requests[request.request_id]
        self._pending.append(request.take_output(finished=True))

    def _pending_and_clear(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        return outputs
