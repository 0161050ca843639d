"""The prefill role: run prompts up to their first sampled token, then pin their state.

A request added here is prefilled by an ordinary :class:`DynamicInferenceEngine` with its
budget cut to what the first token (and any MTP drafts proposed with it) needs. When the step
that samples its first token ends, the engine hands it over
(:meth:`~DynamicInferenceEngine.detach_for_handoff`): the request leaves the engine and the
context's request table, while a :class:`Pin` keeps its KV block references (the partial last
block included) and its Mamba slot (holding the final state), and a
:class:`~megatron.core.inference.handoff.metadata.HandoffRecord` describes them.

A pin ends on the decode side's word: :meth:`PrefillSide.release` (no transfer can read it any
more: storage freed) or :meth:`PrefillSide.abandon` (a read may still be in flight: storage
quarantined until a later release). A pin nobody spoke for within ``pin_timeout_s`` is freed
only when the transport can tell that no read of it can still run
(:meth:`~HandoffTransport.may_still_read`), else it is quarantined; :meth:`PrefillSide.expire_pins`
also frees every quarantined pin as soon as the transport tells so (for NIXL: every expected
reader is gone), so a pin whose word never comes does not stay quarantined for good.
:meth:`PrefillSide.storage_stats` says where the storage is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from megatron.core.inference.contexts.dynamic_context import RequestState
from megatron.core.inference.contexts.prefix_cache import BlockHashChain
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.engines.requests import RequestOutput
from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout
from megatron.core.inference.handoff.plan import CONV_REGION, KV_REGION, SSM_REGION
from megatron.core.inference.handoff.transport import HandoffTransport
from megatron.core.inference.model_runner import model_is_hybrid
from megatron.core.inference.prompts import prompt_token_ids
from megatron.core.inference.sampling import SamplingParams


def cache_regions(context) -> tuple[dict, dict[str, int]]:
    """The tensors a handoff reads or writes (the KV buffer ``[2, layers, blocks, ...]`` and, with
    Mamba layers, the state slots ``[layers, slots, ...]``) and their units: the bytes of one block,
    of one slot row, what every run of equal-head layouts is a whole number of."""
    regions = {KV_REGION: context.kv_cache.data}
    if context.mamba_slots is not None:
        regions |= {CONV_REGION: context.mamba_slots.conv, SSM_REGION: context.mamba_slots.ssm}
    units = {
        name: tensor.stride(2 if name == KV_REGION else 1) * tensor.element_size() for name, tensor in regions.items()
    }
    return regions, units


@dataclass
class Pin:
    """A handed-off request's storage, held until the decode side's word (or the timeout)."""

    record: HandoffRecord
    state: RequestState
    created_at: float
    quarantined: bool = False


@dataclass
class PrefillStep:
    """What one :meth:`PrefillSide.step` produced: records of newly pinned requests, and terminal
    outputs of requests that ended on the prefill engine (finished at their first token, aborted
    or failed) — those have nothing to hand off."""

    records: list[HandoffRecord]
    finished: list[RequestOutput]


class PrefillSide:
    """Prefill role around one engine (see module doc).

    Args:
        engine: the prefill engine of this rank.
        transport: registers this rank's cache and serves pulls.
        pin_timeout_s: how long a pin waits for the decode side's word.
        group: the engine's model-parallel group (tp x pp) when it has several ranks; every
            rank's layout goes into each record (all ranks must construct this together).
        clock: seconds, for the timeout (monotonic by default).
    """

    def __init__(
        self,
        engine: DynamicInferenceEngine,
        transport: HandoffTransport,
        *,
        pin_timeout_s: float = 60.0,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine
        # A pinned request's state must stop at its prompt: no step may run ahead of the pin.
        engine.set_overlap_steps(False)
        self.context = engine.context
        self.transport = transport
        self.pin_timeout_s = pin_timeout_s
        self.clock = clock
        self.is_hybrid = model_is_hybrid(engine.model)
        transport.register(*cache_regions(self.context))
        transport.is_servable = lambda transfer_id: transfer_id in self.pins
        pg = engine.runner.pg
        layout = SourceLayout.of_context(self.context, transport.export(), pg.rank("tp"), pg.size("tp")).to_dict()
        layouts = [layout]
        if group is not None and dist.get_world_size(group) > 1:
            layouts = [None] * dist.get_world_size(group)
            dist.all_gather_object(layouts, layout, group=group)
        self.sources = [SourceLayout.from_dict(entry) for entry in layouts]
        self.pins: dict[str, Pin] = {}
        self.quarantine: dict[str, Pin] = {}
        self._prefilling: set[str] = set()
        self.stats = dict(records=0, released=0, quarantined=0, expired=0)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_tokens: Sequence[int], sampling_params: SamplingParams) -> None:
        """Queue a prompt for prefill (raises the engine's typed admission errors)."""
        prompt = prompt_token_ids(prompt_tokens, self.engine.tokenizer)
        room = self.engine.max_sequence_length - len(prompt)
        budget = sampling_params.max_tokens or room
        # The first token plus the drafts proposed with it: a larger budget would only ask the
        # prefill pool for blocks it never uses. (A budget of 1 finishes here.)
        params = dataclasses.replace(sampling_params, max_tokens=min(budget, 2 + self.engine.num_speculative_tokens))
        self.engine.add_request(request_id, prompt, params)
        self._prefilling.add(request_id)

    def abort(self, request_id: str) -> None:
        """End a request still prefilling (its abort output comes from :meth:`step`); for a pin,
        the same as :meth:`release` (the decode side aborted before pulling)."""
        if request_id in self._prefilling:
            self.engine.abort(request_id)
        else:
            self.release(request_id)

    def step(self) -> PrefillStep:
        """Step the engine; pin every request that sampled its first token."""
        self.transport.serve()
        records, finished = [], []
        for output in self.engine.step():
            if output.request_id not in self._prefilling:
                continue
            if output.finished:
                self._prefilling.discard(output.request_id)
                finished.append(output)
            elif output.new_token_ids:
                self._prefilling.discard(output.request_id)
                records.append(self._pin(output.request_id))
        return PrefillStep(records, finished)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _pin(self, request_id: str) -> HandoffRecord:
        request, state = self.engine.detach_for_handoff(request_id)
        prompt = request.prompt_tokens
        chain = BlockHashChain(self.context.block_size)
        chain.extend(prompt)
        params = request.sampling_params
        generator_state = None
        if request.generator is not None:
            generator_state = request.generator.get_state().numpy().tobytes()
        record = HandoffRecord(
            request_id=request_id,
            prompt_tokens=list(prompt),
            block_size=self.context.block_size,
            block_ids=state.block_ids[: self.context.blocks_for_tokens(len(prompt))],
            block_hashes=chain.hashes,
            resume_tokens=list(request.generated_tokens) + list(request.drafts),
            resume_log_probs=list(request.generated_log_probs),
            sources=self.sources,
            is_hybrid=self.is_hybrid,
            mamba_slot=state.mamba_slot,
            prompt_log_probs=list(request.prompt_log_probs) if params.return_prompt_logprobs else None,
            generator_state=generator_state,
            resume_top_log_probs=list(request.generated_top_log_probs) if params.top_logprobs else None,
        )
        self.pins[request_id] = Pin(record, state, self.clock())
        self.stats["records"] += 1
        return record

    # ---- the decode side's word -------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """No transfer can read the pin any more: free its storage (once; unknown ids ignored)."""
        pin = self.pins.pop(request_id, None) or self.quarantine.pop(request_id, None)
        if pin is not None:
            self.context.release_detached(pin.state)
            self.stats["released"] += 1

    def abandon(self, request_id: str) -> None:
        """The decode side gave up while a read of the pin may still be in flight: keep the
        storage out of use (quarantine) until a later :meth:`release`."""
        pin = self.pins.pop(request_id, None)
        if pin is not None:
            pin.quarantined = True
            self.quarantine[request_id] = pin
            self.stats["quarantined"] += 1

    def expire_pins(self) -> list[str]:
        """Handle pins past ``pin_timeout_s``: freed when no read can still run, else
        quarantined; then free every quarantined pin that no read can reach any more. Returns
        the ids that expired."""
        now = self.clock()
        expired = [rid for rid, pin in self.pins.items() if now - pin.created_at > self.pin_timeout_s]
        for request_id in expired:
            self.stats["expired"] += 1
            if self.transport.may_still_read(request_id):
                self.abandon(request_id)
            else:
                self.release(request_id)
        for request_id in [rid for rid in self.quarantine if not self.transport.may_still_read(rid)]:
            self.release(request_id)
        return expired

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(pin.state.block_ids) for pin in (*self.pins.values(), *self.quarantine.values()))

    def storage_stats(self) -> dict[str, int | bool]:
        """Where this side's storage is: requests prefilling, pins, quarantined pins, the blocks
        they hold, the context's free and total blocks and Mamba slots; ``idle`` when nothing is
        held (every block and slot free, nothing prefilling, pinned or quarantined)."""
        context = self.context
        stats = dict(
            prefilling=len(self._prefilling),
            pins=len(self.pins),
            quarantined_pins=len(self.quarantine),
            pinned_blocks=self.num_pinned_blocks,
            **context.storage_counts(),
        )
        stats["idle"] = context.storage_all_free(stats) and not any(
            stats[k] for k in ("prefilling", "pins", "quarantined_pins")
        )
        return stats
