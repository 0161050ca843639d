"""The decode role: validate a handoff, wait for room, pull what is missing, enter decode.

:meth:`DecodeSide.submit` validates a :class:`HandoffRecord` before anything is queued:
prefix caching must be on here (imports are matched against, and entered into, the prefix
cache), Mamba metadata is present exactly when the model is hybrid, the resume tokens (first
token, then drafts) are consistent, the block ids and hashes match the prompt, prompt plus
continuation fits the pool at all (with the engine's sequence-length and budget rules; the
per-step prompt limit does not apply), and the pulls can be planned (peer descriptors of this
transport, matching head dims, block size, dtypes and Mamba shapes, every local head and layer
held by some prefill rank). A failure raises a typed
:class:`~megatron.core.inference.errors.InferenceRequestError`; nothing was queued.

Imports that fit wait in FIFO order until the pool has room (blocks, a Mamba slot, a request
place). Each step, the head imports start in order: the context shares the blocks already in
the local prefix cache and allocates the rest untouched (reason ``import``) plus the
continuation pages for the resume tokens (reason ``handoff_continuation``, zeroed); one pull
per source rank fetches only the missing suffix of blocks (and the Mamba state); with
``layers_per_pull`` the pulls are cut into layer groups posted back to back (one pull per
source rank and group, :meth:`PendingImport.landed_groups` says how many leading groups have
landed); when every pull is done the blocks enter the prefix cache and the request enters
decode directly (query = resume tokens, KV offset = prompt length).

Failures, pulls pending longer than ``pull_timeout_s`` and aborts (see :meth:`DecodeSide.abort`)
end a request at once, with one terminal output from the next :meth:`DecodeSide.step`. The
storage its pulls target is *quarantined* (:attr:`DecodeSide.quarantined`) while any of them
may still write it (:meth:`~HandoffTransport.may_still_write`), everything else is released;
every step polls the quarantined pulls and reclaims their storage once they all ended (done,
failed, or their peer disconnected), releasing their handles. While quarantined storage is
past ``max_quarantined_fraction`` of the blocks or Mamba slots, new pulls are refused with
:class:`QuarantineFullError` (at submission and in the queue), as is a queued import that
cannot fit beside the quarantined storage at all, rather than wait on storage that may never
come back.

The prefill side's word for each request is queued in :attr:`DecodeSide.words`:
``("release", id)`` once no pull of ours can read its pin any more, ``("abandon", id)`` when a
request ended while one still may (a ``release`` follows when it ends).
:meth:`DecodeSide.storage_stats` says where the storage is (idle, quarantined, open transfers).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.core.inference.contexts.block_allocator import PageReason
from megatron.core.inference.contexts.dynamic_context import ImportPlan
from megatron.core.inference.contexts.prefix_cache import BlockHashChain
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.engines.requests import RequestOutput
from megatron.core.inference.errors import InferenceRequestError
from megatron.core.inference.handoff.failures import (
    HandoffConfigError,
    HandoffMetadataError,
    HandoffRejectedError,
    QuarantineFullError,
    TransferFailedError,
    TransferSubmitError,
)
from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout
from megatron.core.inference.handoff.plan import Segment, check_plan, layer_groups, plan_kv, plan_mamba
from megatron.core.inference.handoff.prefill_side import cache_regions
from megatron.core.inference.handoff.transport import HandoffTransport, PullHandle, TransferState, TransportError
from megatron.core.inference.model_runner import model_is_hybrid
from megatron.core.inference.sampling import SamplingParams

logger = logging.getLogger(__name__)

RELEASE, ABANDON = "release", "abandon"
_PENDING, _DONE, _FAILED = 0, 1, 2


@dataclass
class QuarantinedStorage:
    """Blocks and a Mamba slot that pulls of an ended request may still write: never handed out
    again until every pull in ``handles`` ended. ``announced``: the prefill side was told to
    abandon the pin."""

    request_id: str
    block_ids: list[int]
    mamba_slot: int | None
    handles: list[PullHandle]
    announced: bool = False


@dataclass
class PendingImport:
    """A validated import: waiting for room (no plan yet), or pulling (plan, handles and start
    time set; ``groups[i]`` is the layer group of ``handles[i]``; ``error`` is a transport fault
    seen while polling)."""

    request_id: str
    record: HandoffRecord
    params: SamplingParams
    plan: ImportPlan | None = None
    handles: list[PullHandle] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    started_at: float = 0.0
    error: str | None = None

    def landed_groups(self) -> int:
        """How many leading layer groups have landed: every pull of theirs seen done (by the
        last poll), so their layers' KV and state are in place."""
        landed = 0
        for group in range(max(self.groups, default=-1) + 1):
            states = [h.state for h, g in zip(self.handles, self.groups, strict=True) if g == group]
            if any(state is not TransferState.DONE for state in states):
                break
            landed += 1
        return landed


class DecodeSide:
    """Decode role around one engine (see module doc).

    Args:
        engine: the decode engine of this rank (prefix caching on).
        transport: registers this rank's cache and pulls.
        group: the engine's model-parallel group when it has several ranks: every rank submits
            the same records and steps together, and they agree on each pull's outcome (all
            ranks must construct this together).
        pull_timeout_s: how long an import's pulls may stay pending before it fails.
        max_quarantined_fraction: share of the KV blocks (and of the Mamba slots) that
            quarantined storage may hold before new pulls are refused.
        clock: seconds, for the timeout (monotonic by default).
        layers_per_pull: cut each import's pulls into groups of this many of the rank's layers
            (model order), posted back to back; None: one pull per source rank.
    """

    def __init__(
        self,
        engine: DynamicInferenceEngine,
        transport: HandoffTransport,
        *,
        group: dist.ProcessGroup | None = None,
        pull_timeout_s: float = 30.0,
        max_quarantined_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        layers_per_pull: int | None = None,
    ):
        if pull_timeout_s <= 0 or not 0 <= max_quarantined_fraction < 1:
            raise HandoffConfigError(
                f"pull_timeout_s must be > 0 and max_quarantined_fraction in [0, 1), got {pull_timeout_s} "
                f"and {max_quarantined_fraction}"
            )
        if layers_per_pull is not None and (not isinstance(layers_per_pull, int) or layers_per_pull < 1):
            raise HandoffConfigError(f"layers_per_pull must be None or an int >= 1, got {layers_per_pull!r}")
        self.layers_per_pull = layers_per_pull
        self.engine = engine
        self.context = engine.context
        self.transport = transport
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.pull_timeout_s = pull_timeout_s
        self.max_quarantined_fraction = max_quarantined_fraction
        self.clock = clock
        self.is_hybrid = model_is_hybrid(engine.model)
        transport.register(*cache_regions(self.context))
        pg = engine.runner.pg
        self.layout = SourceLayout.of_context(self.context, {}, pg.rank("tp"), pg.size("tp"))
        # Every rank's descriptor: what a prefill side probes to learn that its readers are gone.
        self.readers = [transport.export()]
        if self.group is not None:
            self.readers = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(self.readers, transport.export(), group=self.group)
        self.waiting: deque[PendingImport] = deque()
        self.pulling: dict[str, PendingImport] = {}
        self.quarantined: list[QuarantinedStorage] = []
        self.words: list[tuple[str, str]] = []
        self._outputs: list[RequestOutput] = []
        self.stats = dict(
            imports=0,
            transferred_bytes=0,
            transfer_seconds=0.0,
            pulls=0,
            rejected=0,
            refused=0,
            failed=0,
            timed_out=0,
            aborted=0,
            reclaimed=0,
        )

    # ---- validation -------------------------------------------------------------------------
    def check(self, request_id: str, record: HandoffRecord, params: SamplingParams) -> int:
        """Raise the typed error of a handoff this side can never take; else return its budget."""

        def reject(reason):
            return HandoffRejectedError(request_id=request_id, reason=reason)

        def bad(name, problem):
            return HandoffMetadataError(request_id=request_id, field=name, problem=problem)

        context, prompt = self.context, record.prompt_tokens
        if not context.enable_prefix_caching:
            raise reject("the decode engine runs without prefix caching; imports need it on")
        if request_id in self.pulling or any(imp.request_id == request_id for imp in self.waiting):
            raise reject("a handoff with this request id is already in progress")
        has_mamba = record.mamba_slot is not None or any(s.mamba is not None for s in record.sources)
        if record.is_hybrid != self.is_hybrid or has_mamba != self.is_hybrid:
            raise bad(
                "mamba",
                f"the record {'has' if has_mamba else 'lacks'} Mamba state (is_hybrid="
                f"{record.is_hybrid}) but this model is {'' if self.is_hybrid else 'not '}hybrid; "
                f"Mamba metadata must be present exactly for hybrid models",
            )
        if record.block_size != context.block_size:
            raise bad("block_size", f"{record.block_size} != this engine's {context.block_size}")
        num_resume = len(record.resume_tokens)
        if num_resume < 1 or len(record.resume_log_probs) != 1 or (self.is_hybrid and num_resume > 1):
            raise bad(
                "resume_tokens",
                f"{num_resume} resume tokens with {len(record.resume_log_probs)} log-probs; "
                f"expected the first sampled token (one log-prob) plus MTP drafts "
                f"(none for hybrid models)",
            )
        if len(record.block_ids) != context.blocks_for_tokens(len(prompt)):
            raise bad(
                "block_ids",
                f"{len(record.block_ids)} blocks for a {len(prompt)}-token prompt; expected "
                f"{context.blocks_for_tokens(len(prompt))} of {context.block_size} tokens",
            )
        chain = BlockHashChain(context.block_size)
        chain.extend(prompt)
        if list(record.block_hashes) != chain.hashes:
            raise bad("block_hashes", "they are not the chained hashes of the prompt's full blocks")
        for source in record.sources:
            try:
                self.transport.check_peer(source.peer)
            except TransportError as exc:
                raise bad("sources", str(exc)) from exc
        check_plan(record, self.layout)
        max_new = self.engine.check_request(request_id, list(prompt), params, prefilled_import=True)
        vocab = self.engine.model.vocab_size
        if num_resume > max_new or any(not 0 <= t < vocab for t in record.resume_tokens):
            raise bad(
                "resume_tokens", f"{num_resume} resume tokens for a budget of {max_new}, ids must be in [0, {vocab})"
            )
        return max_new

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, request_id: str, record: HandoffRecord, params: SamplingParams) -> None:
        """Validate (raising typed errors, queueing nothing) and queue an import in FIFO order;
        raises :class:`QuarantineFullError` while new pulls are refused."""
        try:
            self.check(request_id, record, params)
        except InferenceRequestError:
            self.stats["rejected"] += 1
            raise
        problem = self._quarantine_problem()
        if problem is not None:
            self.stats["refused"] += 1
            raise QuarantineFullError(request_id=request_id, reason=problem)
        self.waiting.append(PendingImport(request_id, record, params))

    def abort(self, request_id: str) -> None:
        """End a request in any state; its terminal output comes from the next :meth:`step`. A
        queued import never starts; a pulling one ends at once (its pull targets stay
        quarantined until the pulls end); an admitted one is aborted by the engine."""
        for imp in self.waiting:
            if imp.request_id == request_id:
                self.waiting.remove(imp)
                self._terminal(imp, "abort")
                self.words.append((RELEASE, request_id))
                return
        if request_id in self.pulling:
            self._fail(self.pulling[request_id], None)
            return
        self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.pulling or self._outputs or self.engine.has_unfinished_requests())

    def has_work(self) -> bool:
        """Unfinished requests, or quarantined storage that :meth:`step` still has to reclaim."""
        return self.has_unfinished_requests() or bool(self.quarantined)

    def take_words(self) -> list[tuple[str, str]]:
        words, self.words = self.words, []
        return words

    def step(self) -> list[RequestOutput]:
        """Progress pulls, reclaim quarantined storage whose pulls ended, start the imports that
        fit (FIFO), step the engine; returns outputs."""
        self._progress()
        self._reclaim()
        self._start_waiting()
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        taken, self._outputs = self._outputs, []
        return taken + outputs

    # ---- storage ----------------------------------------------------------------------------
    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(entry.block_ids) for entry in self.quarantined)

    @property
    def num_quarantined_slots(self) -> int:
        return sum(entry.mamba_slot is not None for entry in self.quarantined)

    def storage_stats(self) -> dict[str, int | bool]:
        """Where this side's storage is: imports waiting / pulling, quarantined imports, blocks
        and Mamba slots, transfers not released, the context's requests and its free and total
        blocks and slots; ``idle`` when nothing is held (every block and slot free, nothing
        waiting, pulling, quarantined or open)."""
        context = self.context
        stats = dict(
            waiting=len(self.waiting),
            pulling=len(self.pulling),
            quarantined_imports=len(self.quarantined),
            quarantined_blocks=self.num_quarantined_blocks,
            quarantined_mamba_slots=self.num_quarantined_slots,
            open_transfers=self.transport.num_open,
            requests=context.num_requests,
            **context.storage_counts(),
        )
        stats["idle"] = context.storage_all_free(stats) and not any(
            stats[k] for k in ("waiting", "pulling", "quarantined_imports", "open_transfers", "requests")
        )
        return stats

    def _quarantine_problem(self) -> str | None:
        """Why new pulls are refused now (quarantined storage past its bound), or None."""
        capacity, limit = self.context.capacity, self.max_quarantined_fraction
        blocks, slots = self.num_quarantined_blocks, self.num_quarantined_slots
        num_slots = self.context.mamba_slots.num_slots if self.context.mamba_slots is not None else 0
        if blocks <= limit * capacity.num_blocks and slots <= limit * num_slots:
            return None
        return (
            f"{blocks} of {capacity.num_blocks} KV blocks and {slots} of {num_slots} Mamba slots are quarantined "
            f"behind transfers that have not ended, past max_quarantined_fraction={limit:g}"
        )

    def _fits_beside_quarantine(self, record: HandoffRecord) -> bool:
        """Whether the import could fit at all while the quarantined storage stays held."""
        context = self.context
        needed = context.blocks_for_tokens(len(record.prompt_tokens) + len(record.resume_tokens))
        slots_ok = context.mamba_slots is None or self.num_quarantined_slots < context.mamba_slots.num_slots
        return needed <= context.capacity.num_blocks - self.num_quarantined_blocks and slots_ok

    def _reclaim(self) -> None:
        """Poll the quarantined pulls; give back the storage of every entry whose pulls all
        ended (on every rank), then tell the prefill side to release the pin."""
        if not self.quarantined:
            return
        codes = []
        for entry in self.quarantined:
            for handle in entry.handles:
                try:
                    self.transport.poll(handle)
                except TransportError as exc:  # the transport cannot tell: keep it quarantined
                    logger.warning("polling quarantined pull of %r: %s", entry.request_id, exc)
            codes.append(_PENDING if any(self.transport.may_still_write(h) for h in entry.handles) else _DONE)
        kept = []
        for entry, code in zip(self.quarantined, self._agree(codes), strict=True):
            if code != _DONE:
                if not entry.announced:
                    entry.announced = True
                    self.words.append((ABANDON, entry.request_id))
                kept.append(entry)
                continue
            for handle in entry.handles:
                self._release(handle)
            self.context.pool.free(entry.block_ids)
            if entry.mamba_slot is not None:
                self.context.mamba_slots.free(entry.mamba_slot)
            self.stats["reclaimed"] += 1
            self.words.append((RELEASE, entry.request_id))
        self.quarantined = kept

    def _release(self, handle: PullHandle) -> None:
        try:
            self.transport.release(handle)
        except TransportError as exc:  # the handle is the transport's to keep; the storage is ours
            logger.warning("releasing pull of %r: %s", handle.transfer_id, exc)

    # ---- starting ---------------------------------------------------------------------------
    def fits_now(self, record: HandoffRecord) -> bool:
        """Whether the pool, the request cap and the Mamba slots have room for this import now."""
        context = self.context
        cached = context.pool.find_cached_prefix(record.block_hashes)
        needed = context.blocks_for_tokens(len(record.prompt_tokens) + len(record.resume_tokens)) - len(cached)
        available = context.num_free_blocks - sum(1 for b in cached if context.pool.ref_count(b) == 0)
        slots_ok = context.mamba_slots is None or context.mamba_slots.num_free_slots > 0
        return needed <= available and context.num_requests < context.capacity.max_requests and slots_ok

    def _start_waiting(self) -> None:
        while self.waiting:
            imp, problem = self.waiting[0], self._quarantine_problem()
            if problem is None and self.fits_now(imp.record):
                self.waiting.popleft()
                try:
                    self.start(imp)
                except TransferSubmitError:  # start() ended the request with its one terminal output
                    self._reclaim()
            elif problem is not None or not self._fits_beside_quarantine(imp.record):
                self.waiting.popleft()
                self._refuse(imp, problem or "it cannot fit beside the storage quarantined behind unfinished transfers")
            else:
                break

    def _refuse(self, imp: PendingImport, reason: str) -> None:
        self.stats["refused"] += 1
        self.words.append((RELEASE, imp.request_id))
        self._terminal(imp, "error", QuarantineFullError(request_id=imp.request_id, reason=reason))

    def start(self, imp: PendingImport) -> None:
        """Admit the import into the context and post its pulls; raises
        :class:`TransferSubmitError` (after ending the request with its terminal output and
        quarantining what a posted pull may write) when a pull cannot start."""
        record, context, request_id = imp.record, self.context, imp.request_id
        prompt, resume = record.prompt_tokens, record.resume_tokens
        imp.plan = context.import_request(request_id, prompt, resume[:1])
        context.ensure_token_capacity(request_id, len(prompt) + len(resume), PageReason.HANDOFF_CONTINUATION)
        if len(resume) > 1:
            context.append_draft_tokens(request_id, resume[1:])
        self.pulling[request_id] = imp
        imp.started_at = self.clock()
        error = None
        try:
            for group, layers in enumerate(layer_groups(self.layout, self.layers_per_pull)):
                for source, segments in self._plan(imp, layers).items():
                    imp.handles.append(self.transport.post_pull(request_id, record.sources[source].peer, segments))
                    imp.groups.append(group)
        except TransportError as exc:
            error = str(exc)
        failed = self._agree([_FAILED if error else _DONE])[0] == _FAILED
        if failed:
            self.stats["failed"] += 1
            exc = TransferSubmitError(
                request_id=request_id,
                transport=self.transport.name,
                reason=error or "a peer rank of this engine could not start its pull",
            )
            self._fail(imp, exc)
            raise exc
        self.stats["pulls"] += len(imp.handles)

    def _plan(self, imp: PendingImport, layers: tuple[int, ...]) -> dict[int, list[Segment]]:
        """The runs of ``layers`` (global numbers) by source rank."""
        plan, record = imp.plan, imp.record
        segments = (
            plan_kv(record, self.layout, record.block_ids[plan.first_block_index :], plan.block_ids, layers)
            if self.layout.attention_layers
            else []
        )
        if self.layout.mamba_layers:
            segments += plan_mamba(record, self.layout, plan.mamba_slot, layers)
        by_source: dict[int, list[Segment]] = {}
        for seg in segments:
            by_source.setdefault(seg.source, []).append(seg)
        return by_source

    # ---- progress ---------------------------------------------------------------------------
    def _progress(self) -> None:
        imports, codes, now = list(self.pulling.values()), [], self.clock()
        for imp in imports:
            states = []
            for handle in imp.handles:
                try:
                    states.append(self.transport.poll(handle))
                except TransportError as exc:  # the pull fails; the handle stays, as it may still run
                    imp.error = str(exc)
                    states.append(TransferState.FAILED)
            code = _FAILED if TransferState.FAILED in states else _PENDING if TransferState.PENDING in states else _DONE
            if code == _PENDING and now - imp.started_at > self.pull_timeout_s:
                imp.error = f"no answer within pull_timeout_s={self.pull_timeout_s:g}"
                self.stats["timed_out"] += 1
                code = _FAILED
            codes.append(code)
        for imp, code in zip(imports, self._agree(codes), strict=True):
            if code == _DONE:
                self._finish_pull(imp)
            elif code == _FAILED:
                self.stats["failed"] += 1
                reason = imp.error or next(
                    (h.error for h in imp.handles if h.error), "a peer rank of this engine failed its pull"
                )
                self._fail(
                    imp, TransferFailedError(request_id=imp.request_id, transport=self.transport.name, reason=reason)
                )

    def _agree(self, codes: list[int]) -> list[int]:
        """Every rank's view of each pull: failed if failed anywhere, done if done everywhere."""
        if self.group is None or not codes:
            return codes
        failed = torch.tensor([c == _FAILED for c in codes], dtype=torch.int64)
        done = torch.tensor([c != _PENDING for c in codes], dtype=torch.int64)
        dist.all_reduce(failed, dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(done, dist.ReduceOp.MIN, group=self.group)
        return [_FAILED if f else _DONE if d else _PENDING for f, d in zip(failed.tolist(), done.tolist(), strict=True)]

    def _finish_pull(self, imp: PendingImport) -> None:
        del self.pulling[imp.request_id]
        for handle in imp.handles:
            self.stats["transferred_bytes"] += handle.nbytes
            self.stats["transfer_seconds"] += handle.seconds or 0.0
            self._release(handle)
        self.words.append((RELEASE, imp.request_id))
        record = imp.record
        self.context.commit_import(imp.request_id)
        generator_state = None
        if record.generator_state is not None:
            generator_state = torch.frombuffer(bytearray(record.generator_state), dtype=torch.uint8)
        self.engine.admit_imported(
            imp.request_id,
            record.prompt_tokens,
            imp.params,
            generated_tokens=record.resume_tokens[:1],
            generated_log_probs=record.resume_log_probs,
            prompt_log_probs=record.prompt_log_probs,
            generator_state=generator_state,
            generated_top_log_probs=record.resume_top_log_probs,
        )
        self.stats["imports"] += 1

    def _fail(self, imp: PendingImport, error: InferenceRequestError | None) -> None:
        """End a pulling import (``error`` None: aborted) with one terminal output: release what
        no pull writes (shared cached blocks, continuation pages) and quarantine the pull targets
        with the pulls; :meth:`_reclaim` gives them back once every pull ended."""
        del self.pulling[imp.request_id]
        state = self.context.detach_request(imp.request_id)
        targets = list(imp.plan.block_ids)
        kept = set(targets)
        self.context.pool.free([b for b in state.block_ids if b not in kept])
        self.quarantined.append(QuarantinedStorage(imp.request_id, targets, imp.plan.mamba_slot, list(imp.handles)))
        self._terminal(imp, "abort" if error is None else "error", error)

    def _terminal(self, imp: PendingImport, reason: str, error: InferenceRequestError | None = None) -> None:
        if reason == "abort":
            self.stats["aborted"] += 1
        self._outputs.append(
            RequestOutput(
                request_id=imp.request_id,
                new_token_ids=[],
                new_log_probs=[],
                new_text="",
                finished=True,
                finish_reason=reason,
                error=error.to_dict() if error is not None else None,
                prompt_log_probs=None,
                prompt_tokens=len(imp.record.prompt_tokens),
                generated_tokens=0,
            )
        )
