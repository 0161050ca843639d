"""The decode role: validate a handoff, wait for room, pull what is missing, enter decode.

:meth:`DecodeSide.submit` validates a :class:`HandoffRecord` before anything is queued:
prefix caching must be on here (imports are matched against, and entered into, the prefix
cache), Mamba metadata is present exactly when the model is hybrid, the resume tokens (first
token, then drafts) are consistent, the block ids and hashes match the prompt, and prompt plus
continuation fits the pool at all (with the engine's sequence-length and budget rules; the
per-step prompt limit does not apply). A failure raises a typed
:class:`~megatron.core.inference.contexts.errors.InferenceRequestError`; nothing was queued.

Imports that fit wait in FIFO order until the pool has room (blocks, a Mamba slot, a request
place). Each step, the head imports start in order: the context shares the blocks already in
the local prefix cache and allocates the rest untouched (reason ``import``) plus the
continuation pages for the resume tokens (reason ``handoff_continuation``, zeroed); one pull
per source rank fetches only the missing suffix of blocks (and the Mamba state); when every
pull is done the blocks enter the prefix cache and the request enters decode directly
(query = resume tokens, KV offset = prompt length).

Failures and aborts (see :meth:`DecodeSide.abort`) end a request with one terminal output
from :meth:`DecodeSide.step`. Storage a failed pull may still write is quarantined; the rest
is released. The prefill side's word for each request is queued in :attr:`DecodeSide.words`:
``("release", id)`` when no pull of ours can read its pin any more, ``("abandon", id)`` when
one may.
"""

from __future__ import annotations

from collections import deque
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
    HandoffMetadataError,
    HandoffRejectedError,
    TransferFailedError,
    TransferSubmitError,
)
from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout
from megatron.core.inference.handoff.plan import Segment, plan_kv, plan_mamba
from megatron.core.inference.handoff.prefill_side import cache_regions
from megatron.core.inference.handoff.transport import HandoffTransport, PullHandle, TransferState, TransportError
from megatron.core.inference.model_runner import model_is_hybrid
from megatron.core.inference.sampling import SamplingParams

RELEASE, ABANDON = "release", "abandon"
_PENDING, _DONE, _FAILED = 0, 1, 2


@dataclass
class QuarantinedStorage:
    """Blocks and a Mamba slot a failed pull may still write: never handed out again."""

    request_id: str
    block_ids: list[int]
    mamba_slot: int | None


@dataclass
class PendingImport:
    """A validated import: waiting for room (no plan yet), or pulling (plan and handles set)."""

    request_id: str
    record: HandoffRecord
    params: SamplingParams
    plan: ImportPlan | None = None
    handles: list[PullHandle] = field(default_factory=list)
    aborted: bool = False


class DecodeSide:
    """Decode role around one engine (see module doc).

    Args:
        engine: the decode engine of this rank (prefix caching on).
        transport: registers this rank's cache and pulls.
        group: the engine's model-parallel group when it has several ranks: every rank submits
            the same records and steps together, and they agree on each pull's outcome.
    """

    def __init__(
        self, engine: DynamicInferenceEngine, transport: HandoffTransport, *, group: dist.ProcessGroup | None = None
    ):
        self.engine = engine
        self.context = engine.context
        self.transport = transport
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.is_hybrid = model_is_hybrid(engine.model)
        transport.register(cache_regions(self.context))
        pg = engine.runner.pg
        self.layout = SourceLayout.of_context(self.context, {}, pg.rank("tp"), pg.size("tp"))
        self.waiting: deque[PendingImport] = deque()
        self.pulling: dict[str, PendingImport] = {}
        self.quarantined: list[QuarantinedStorage] = []
        self.words: list[tuple[str, str]] = []
        self._outputs: list[RequestOutput] = []
        self.stats = dict(
            imports=0, transferred_bytes=0, transfer_seconds=0.0, pulls=0, rejected=0, failed=0, aborted=0
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
        max_new = self.engine.check_request(request_id, list(prompt), params, prefilled_import=True)
        vocab = self.engine.model.vocab_size
        if num_resume > max_new or any(not 0 <= t < vocab for t in record.resume_tokens):
            raise bad(
                "resume_tokens", f"{num_resume} resume tokens for a budget of {max_new}, ids must be in [0, {vocab})"
            )
        return max_new

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, request_id: str, record: HandoffRecord, params: SamplingParams) -> None:
        """Validate (raising typed errors, queueing nothing) and queue an import in FIFO order."""
        try:
            self.check(request_id, record, params)
        except InferenceRequestError:
            self.stats["rejected"] += 1
            raise
        self.waiting.append(PendingImport(request_id, record, params))

    def abort(self, request_id: str) -> None:
        """End a request in any state: a queued import never starts, a pulling one never enters
        decode (storage released once its pulls end), an admitted one is aborted by the engine."""
        for imp in self.waiting:
            if imp.request_id == request_id:
                self.waiting.remove(imp)
                self._terminal(imp, "abort")
                self.words.append((RELEASE, request_id))
                return
        if request_id in self.pulling:
            self.pulling[request_id].aborted = True
            return
        self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.pulling or self._outputs or self.engine.has_unfinished_requests())

    def take_words(self) -> list[tuple[str, str]]:
        words, self.words = self.words, []
        return words

    def step(self) -> list[RequestOutput]:
        """Progress pulls, start the imports that fit (FIFO), step the engine; returns outputs."""
        self._progress()
        self._start_waiting()
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        taken, self._outputs = self._outputs, []
        return taken + outputs

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
        while self.waiting and self.fits_now(self.waiting[0].record):
            imp = self.waiting.popleft()
            try:
                self.start(imp)
            except TransferSubmitError:
                pass  # start() already ended the request with its one terminal output

    def start(self, imp: PendingImport) -> None:
        """Admit the import into the context and post its pulls; raises
        :class:`TransferSubmitError` (after releasing what it took and queueing the request's
        terminal output) when a pull cannot start."""
        record, context, request_id = imp.record, self.context, imp.request_id
        prompt, resume = record.prompt_tokens, record.resume_tokens
        imp.plan = context.import_request(request_id, prompt, resume[:1])
        context.ensure_token_capacity(request_id, len(prompt) + len(resume), PageReason.HANDOFF_CONTINUATION)
        if len(resume) > 1:
            context.append_draft_tokens(request_id, resume[1:])
        self.pulling[request_id] = imp
        error = None
        try:
            for source, segments in self._plan(imp).items():
                imp.handles.append(self.transport.post_pull(request_id, record.sources[source].peer, segments))
        except (TransportError, RuntimeError) as exc:
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

    def _plan(self, imp: PendingImport) -> dict[int, list[Segment]]:
        plan, record = imp.plan, imp.record
        segments = (
            plan_kv(record, self.layout, record.block_ids[plan.first_block_index :], plan.block_ids)
            if self.layout.attention_layers
            else []
        )
        if self.layout.mamba_layers:
            segments += plan_mamba(record, self.layout, plan.mamba_slot)
        by_source: dict[int, list[Segment]] = {}
        for seg in segments:
            by_source.setdefault(seg.source, []).append(seg)
        return by_source

    # ---- progress ---------------------------------------------------------------------------
    def _progress(self) -> None:
        imports = list(self.pulling.values())
        codes = []
        for imp in imports:
            states = []
            for handle in imp.handles:
                try:
                    states.append(self.transport.poll(handle))
                except (TransportError, RuntimeError) as exc:
                    handle._end(TransferState.FAILED, str(exc))
                    states.append(TransferState.FAILED)
            codes.append(
                _FAILED if TransferState.FAILED in states else _PENDING if TransferState.PENDING in states else _DONE
            )
        for imp, code in zip(imports, self._agree(codes), strict=True):
            if code == _DONE:
                self._finish_pull(imp)
            elif code == _FAILED:
                self.stats["failed"] += 1
                reason = next((h.error for h in imp.handles if h.error), "a peer rank of this engine failed its pull")
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
            self.transport.release(handle)
        self.words.append((RELEASE, imp.request_id))
        if imp.aborted:
            self.context.release_request(imp.request_id)
            self._terminal(imp, "abort")
            return
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

    def _fail(self, imp: PendingImport, error: InferenceRequestError) -> None:
        """Release what no pull can write (shared cached blocks, continuation pages); quarantine
        the pull targets while any pull was posted. One terminal output."""
        del self.pulling[imp.request_id]
        state = self.context.detach_request(imp.request_id)
        plan = imp.plan
        targets = set(plan.block_ids) if imp.handles else set()
        if targets:
            self.quarantined.append(QuarantinedStorage(imp.request_id, list(plan.block_ids), plan.mamba_slot))
            self.context.pool.free([b for b in state.block_ids if b not in targets])
        else:
            self.context.release_detached(state)
        still_pending = False
        for handle in imp.handles:
            if handle.state is TransferState.PENDING:
                still_pending = True
            else:
                self.transport.release(handle)
        self.words.append((ABANDON if still_pending else RELEASE, imp.request_id))
        self._terminal(imp, "abort" if imp.aborted else "error", None if imp.aborted else error)

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
