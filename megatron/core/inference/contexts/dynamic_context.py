"""The dynamic inference context of one pipeline stage: paged KV cache, block pool with
prefix caching, Mamba state slots, and the per-step batch the model runs on.

Request lifecycle (called by the engine; every call is all-or-nothing):

* :meth:`~DynamicInferenceContext.check_admission` — the typed admission errors of
  :mod:`errors` (also run by ``add_request`` / ``import_request``).
* :meth:`~DynamicInferenceContext.add_request` — shares the longest cached prefix of the prompt,
  allocates private blocks for the rest (reason ``admission``), and a Mamba slot, zeroed or
  restored from the snapshot of the last shared block.
* :meth:`~DynamicInferenceContext.append_tokens` — record sampled tokens.
* :meth:`~DynamicInferenceContext.append_draft_tokens` /
  :meth:`~DynamicInferenceContext.resolve_draft_tokens` — speculative drafts: computed like
  other tokens but never hashed or cached; after verification the rejected ones are dropped
  and their KV positions rewound (they are rewritten by later tokens).
* :meth:`~DynamicInferenceContext.ensure_token_capacity` — grow a request's blocks for the
  given reason (``decode_growth``, ``lookahead``, ``async_preparation``,
  ``handoff_continuation``); :meth:`pause_request` / :meth:`resume_request` (``resume``);
  :meth:`release_request` (finish or evict; returns the hash chain for re-admission);
  :meth:`detach_request` / :meth:`release_detached` (storage kept past the request: handoff pins).
* :meth:`~DynamicInferenceContext.import_request` / :meth:`commit_import` — handoff: blocks
  not already cached are allocated untouched for the transfer to fill.

Each step:

1. ``batch = context.build_step([(request_id, num_new_tokens), ...], pad_to_tokens=None)``
   packs the requests' uncomputed tokens in order (prefill chunks and decode tokens mixed):
   ``batch.token_ids`` / ``batch.positions`` ``[padded_tokens]`` feed the model as ``[1, T]``,
   so activations are ``[T, 1, h]``. Padding tokens write K/V to the dummy block.
2. The model runs ``forward(..., inference_context=context)``. Two hooks:

   * **Attention**: ``context.store_kv_and_attend(layer_number, q, k, v)`` with this step's
     ``q [T, 1, q_heads/tp, d]`` and ``k, v [T, 1, kv_heads/tp, d]`` (rotary applied) of global
     layer ``layer_number``. Stores K/V at each token's slot in the paged cache, then returns the
     paged attention context ``[T, 1, q_heads/tp, d]`` (causal within each request's new
     tokens, over all its cached tokens; zeros for padding tokens).
   * **Mamba**: ``conv, ssm = context.mamba_states(layer_number)`` gives this layer's state of
     the batch's requests in batch order, ``conv [R, conv_channels, d_conv - 1]`` and
     ``ssm [R, nheads, head_dim, d_state]``; the mixer updates them in place and the context
     writes them back to the request slots at ``commit_step``. Kernels that update the slots
     themselves take ``context.mamba_state_slots(layer_number)`` instead. ``context.is_decode_only()``
     says every request has one new token; otherwise request ``r``'s tokens are
     ``batch.cu_query_lengths[r]:batch.cu_query_lengths[r + 1]`` of the packed batch.
3. ``context.commit_step()`` marks the tokens computed, registers newly full blocks in the
   prefix cache (only now is their KV computed), and snapshots Mamba state at block ends.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from megatron.core.inference.contexts.block_allocator import NO_BLOCK, BlockPool, PageReason
from megatron.core.inference.contexts.capacity import Capacity, CapacityConfig, StageCacheSpec, plan_capacity
from megatron.core.inference.contexts.errors import (
    BlockPoolExhaustedError,
    InferenceContextError,
    LayerNotOnStageError,
    MambaSlotsExhaustedError,
    PromptExceedsStepTokenLimitError,
    PromptTooLongError,
    RequestExceedsPoolError,
    StepError,
    UnknownRequestError,
)
from megatron.core.inference.contexts.kv_cache import PagedKVCache
from megatron.core.inference.contexts.mamba_slots import MambaSnapshotStore, MambaStateSlots
from megatron.core.inference.contexts.paged_attention import paged_attention
from megatron.core.inference.contexts.prefix_cache import BlockHashChain
from megatron.core.process_groups import ProcessGroupCollection


@dataclass
class RequestState:
    """What the context keeps per request."""

    request_id: Hashable
    tokens: list[int]
    hash_chain: BlockHashChain
    block_ids: list[int]
    num_computed_tokens: int
    mamba_slot: int | None
    # Leading blocks of block_ids that are in the prefix cache (shared or registered here).
    num_registered_blocks: int = 0
    # Set when a block's hash was already cached under another block (two requests computed
    # it in the same step): later blocks of this request stay private, since their cached
    # parent would belong to another chain.
    registration_deferred: bool = False
    paused: bool = False
    # Trailing tokens that are speculative drafts (excluded from hashing and caching).
    num_draft_tokens: int = 0

    @property
    def confirmed_tokens(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.num_draft_tokens]


@dataclass(frozen=True)
class StepBatch:
    """The metadata of one forward step (``R`` requests, ``T`` padded tokens)."""

    request_ids: tuple
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], 0 for padding
    slot_mapping: torch.Tensor  # [T], cache slot of each token; padding -> dummy block
    query_lengths: torch.Tensor  # [R]
    cu_query_lengths: torch.Tensor  # [R + 1]
    kv_offsets: torch.Tensor  # [R], tokens already cached before this step
    kv_lengths: torch.Tensor  # [R], kv_offsets + query_lengths
    block_tables: torch.Tensor  # [R, max_blocks], padded with the dummy block
    mamba_slot_ids: torch.Tensor  # [R] on stages with Mamba layers, else empty
    num_tokens: int  # real (unpadded) tokens

    @property
    def num_padded_tokens(self) -> int:
        return self.token_ids.shape[0]


@dataclass(frozen=True)
class ImportPlan:
    """Where a handoff transfer writes: ``block_ids`` (blocks ``first_block_index..`` of the
    request, not already cached here) and the request's Mamba slot (None without Mamba)."""

    block_ids: list[int]
    first_block_index: int
    mamba_slot: int | None
    num_cached_tokens: int


class DynamicInferenceContext:
    """KV blocks, Mamba slots and step metadata of one pipeline stage (see module doc).

    Args:
        spec: what this stage stores (its layers, KV heads and head dim, block size).
        capacity: the numbers agreed by every stage (:func:`capacity.plan_capacity`); use
            :meth:`create` to plan and build in one call.
        max_sequence_length: longest prompt accepted.
        max_tokens_per_step: tokens one step may process.
        is_hybrid_model: the whole model has Mamba layers (True on every stage of it).
        enable_prefix_caching / enable_chunked_prefill: features.
        softmax_scale: attention scale, default ``1 / sqrt(head_dim)``.
    """

    def __init__(
        self,
        spec: StageCacheSpec,
        capacity: Capacity,
        *,
        max_sequence_length: int,
        max_tokens_per_step: int,
        is_hybrid_model: bool = False,
        enable_prefix_caching: bool = False,
        enable_chunked_prefill: bool = False,
        softmax_scale: float | None = None,
        device: torch.device | str | None = None,
    ):
        if spec.mamba_layer_numbers and not is_hybrid_model:
            raise InferenceContextError("this stage holds Mamba layers but is_hybrid_model is False")
        self.spec = spec
        self.capacity = capacity
        self.block_size = spec.block_size
        self.max_sequence_length = max_sequence_length
        self.max_tokens_per_step = max_tokens_per_step
        self.is_hybrid_model = is_hybrid_model
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.softmax_scale = softmax_scale
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # Negative-control switch for tests only: hand out fresh pages without zeroing them.
        self._skip_private_page_init_for_tests = False
        self.kv_cache = PagedKVCache(
            len(spec.attention_layer_numbers),
            capacity.num_blocks + 1,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.kv_dtype,
            self.device,
        )
        self.pool = BlockPool(capacity.num_blocks, page_initializer=self._init_private_pages)
        self.mamba_slots = (
            MambaStateSlots(len(spec.mamba_layer_numbers), capacity.num_mamba_slots, spec.mamba_shapes, self.device)
            if spec.mamba_layer_numbers
            else None
        )
        self.mamba_snapshots = (
            MambaSnapshotStore(
                capacity.num_mamba_snapshots, len(spec.mamba_layer_numbers), spec.mamba_shapes, self.device
            )
            if is_hybrid_model and enable_prefix_caching
            else None
        )
        self._attention_index = {n: i for i, n in enumerate(spec.attention_layer_numbers)}
        self._mamba_index = {n: i for i, n in enumerate(spec.mamba_layer_numbers)}
        self._requests: dict[Hashable, RequestState] = {}
        self.step: StepBatch | None = None
        self._step_mamba_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_deferred_registrations = 0

    @classmethod
    def create(
        cls,
        spec: StageCacheSpec,
        capacity_config: CapacityConfig,
        *,
        max_sequence_length: int,
        max_tokens_per_step: int,
        is_hybrid_model: bool,
        enable_prefix_caching: bool = False,
        enable_chunked_prefill: bool = False,
        pg_collection: ProcessGroupCollection | None = None,
        negotiation_timeout_s: float = 60.0,
        **kwargs,
    ) -> DynamicInferenceContext:
        """Plan the capacity with every pipeline stage (collective over ``pg_collection.pp``:
        all stages must call it) and build this stage's context."""
        capacity = plan_capacity(
            spec,
            capacity_config,
            max_sequence_length=max_sequence_length,
            is_hybrid_model=is_hybrid_model,
            enable_prefix_caching=enable_prefix_caching,
            pg_collection=pg_collection,
            timeout_s=negotiation_timeout_s,
        )
        return cls(
            spec,
            capacity,
            max_sequence_length=max_sequence_length,
            max_tokens_per_step=max_tokens_per_step,
            is_hybrid_model=is_hybrid_model,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            **kwargs,
        )

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def private_page_init_counts(self):
        """Fresh private pages initialized so far, per :class:`PageReason` value."""
        return self.pool.private_page_init_counts

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def request(self, request_id: Hashable) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(f"request {request_id!r} is not in the context")
        return state

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # ---- admission -------------------------------------------------------------------------
    def check_admission(self, prompt_length: int, max_new_tokens: int = 0, *, prefilled_import: bool = False) -> None:
        """Raise the typed error for a request that can never be served here.

        ``prefilled_import=True`` (KV already computed elsewhere) skips only the per-step
        prefill token limit.
        """
        if prompt_length > self.max_sequence_length:
            raise PromptTooLongError(prompt_length=prompt_length, max_sequence_length=self.max_sequence_length)
        num_tokens = prompt_length + max_new_tokens
        if self.blocks_for_tokens(num_tokens) > self.capacity.num_blocks:
            raise RequestExceedsPoolError(
                num_tokens=num_tokens,
                blocks_needed=self.blocks_for_tokens(num_tokens),
                pool_blocks=self.capacity.num_blocks,
                block_size=self.block_size,
            )
        if not (self.enable_chunked_prefill or prefilled_import) and prompt_length > self.max_tokens_per_step:
            raise PromptExceedsStepTokenLimitError(
                prompt_length=prompt_length, max_tokens_per_step=self.max_tokens_per_step
            )

    def add_request(
        self,
        request_id: Hashable,
        prompt_tokens: Sequence[int],
        *,
        max_new_tokens: int = 0,
        hash_chain: BlockHashChain | None = None,
        allow_chunked_prefill: bool = False,
    ) -> int:
        """Admit a request: share its cached prefix, allocate private blocks for the rest of
        the prompt and a Mamba slot. ``hash_chain`` is the chain a released request handed
        back (so it is not rehashed). ``allow_chunked_prefill``: the caller prefills this
        request in chunks even with chunked prefill off (a recompute after eviction, an import
        recomputed locally), so only the per-step token check is skipped. Returns the number
        of prompt tokens found cached."""
        self.check_admission(len(prompt_tokens), max_new_tokens, prefilled_import=allow_chunked_prefill)
        tokens = list(prompt_tokens)
        chain = self._chain_for(tokens, hash_chain)
        # At least one prompt token is always computed, to produce the next token's logits.
        cached = self._match_prefix(chain, (len(tokens) - 1) // self.block_size, needs_mamba_snapshot=True)
        state = self._admit(request_id, tokens, chain, cached, len(tokens), PageReason.ADMISSION)
        if cached and self.mamba_snapshots is not None:
            self.mamba_snapshots.restore(chain.hashes[len(cached) - 1], self.mamba_slots, state.mamba_slot)
        return state.num_computed_tokens

    def import_request(
        self, request_id: Hashable, prompt_tokens: Sequence[int], generated_tokens: Sequence[int] = ()
    ) -> ImportPlan:
        """Admit a request whose prompt KV (and final Mamba state) a transfer will supply.

        Blocks already cached here are shared; the others are allocated without being
        touched (reason ``import``) for the transfer to fill whole. Call :meth:`commit_import`
        once the transfer landed. ``generated_tokens`` (not yet computed) follow the prompt.
        """
        self.check_admission(len(prompt_tokens), len(generated_tokens), prefilled_import=True)
        tokens = list(prompt_tokens)
        chain = self._chain_for(tokens, None)
        # The Mamba state comes with the transfer, so any cached KV prefix can be reused.
        cached = self._match_prefix(chain, len(tokens) // self.block_size, needs_mamba_snapshot=False)
        state = self._admit(request_id, tokens, chain, cached, len(tokens), PageReason.IMPORT)
        state.num_computed_tokens = len(tokens)
        state.tokens.extend(generated_tokens)
        return ImportPlan(state.block_ids[len(cached) :], len(cached), state.mamba_slot, len(cached) * self.block_size)

    def commit_import(self, request_id: Hashable) -> None:
        """The transfer for an imported request completed: its full blocks may be cached."""
        self._register_computed_blocks(self.request(request_id))

    def _chain_for(self, tokens: list[int], hash_chain: BlockHashChain | None) -> BlockHashChain:
        chain = hash_chain if hash_chain is not None else BlockHashChain(self.block_size)
        if self.enable_prefix_caching:
            chain.extend(tokens)
        return chain

    def _match_prefix(self, chain: BlockHashChain, max_blocks: int, needs_mamba_snapshot: bool) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        cached = self.pool.find_cached_prefix(chain.hashes[:max_blocks])
        if needs_mamba_snapshot and self.mamba_snapshots is not None:
            cached = cached[: self.mamba_snapshots.longest_resumable(chain.hashes[: len(cached)])]
        return cached

    def _admit(self, request_id, tokens, chain, cached, num_kv_tokens, reason) -> RequestState:
        if request_id in self._requests:
            raise UnknownRequestError(f"request {request_id!r} is already in the context")
        if len(self._requests) >= self.capacity.max_requests:
            raise InferenceContextError(
                f"the context already holds its maximum of {self.capacity.max_requests} requests"
            )
        num_new = self.blocks_for_tokens(num_kv_tokens) - len(cached)
        available = self.pool.num_free_blocks - sum(1 for b in cached if self.pool.ref_count(b) == 0)
        if num_new > available:
            raise BlockPoolExhaustedError(
                f"request {request_id!r} needs {num_new} new KV blocks but only {available} are free "
                f"(besides its {len(cached)} cached ones); wait for requests to finish"
            )
        # All or nothing: a slot held by a handoff pin (not a request of this context) must not
        # leave the blocks below taken.
        if self.mamba_slots is not None and self.mamba_slots.num_free_slots == 0:
            raise MambaSlotsExhaustedError(
                f"request {request_id!r} needs a Mamba state slot but all {self.capacity.num_mamba_slots} are held "
                f"(by requests or handoff pins); wait for them to be released"
            )
        self.pool.share(cached)
        block_ids = list(cached) + self.pool.allocate(num_new, reason)
        slot = self.mamba_slots.allocate() if self.mamba_slots is not None else None
        state = RequestState(
            request_id, tokens, chain, block_ids, len(cached) * self.block_size, slot, num_registered_blocks=len(cached)
        )
        self._requests[request_id] = state
        return state

    # ---- growth and release ----------------------------------------------------------------
    def append_tokens(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Record tokens sampled for a request (their KV is computed by a later step)."""
        self.request(request_id).tokens.extend(tokens)

    def append_draft_tokens(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Record speculative draft tokens after the request's tokens (computed by the next
        step, never hashed or cached until :meth:`resolve_draft_tokens` confirms them)."""
        state = self.request(request_id)
        if state.num_draft_tokens:
            raise StepError(f"request {request_id!r} still has {state.num_draft_tokens} unresolved draft tokens")
        state.tokens.extend(tokens)
        state.num_draft_tokens = len(tokens)

    def resolve_draft_tokens(self, request_id: Hashable, num_accepted: int) -> None:
        """Keep the first ``num_accepted`` drafts as ordinary tokens and drop the rest, rewinding
        the computed-token count past them (their KV slots are rewritten by later tokens)."""
        state = self.request(request_id)
        if not 0 <= num_accepted <= state.num_draft_tokens:
            raise StepError(
                f"request {request_id!r} has {state.num_draft_tokens} draft tokens; cannot accept {num_accepted}"
            )
        rejected = state.num_draft_tokens - num_accepted
        del state.tokens[len(state.tokens) - rejected :]
        state.num_computed_tokens = min(state.num_computed_tokens, len(state.tokens))
        state.num_draft_tokens = 0
        if self.enable_prefix_caching:
            state.hash_chain.extend(state.tokens[: state.num_computed_tokens])
            self._register_computed_blocks(state)

    def ensure_token_capacity(self, request_id: Hashable, num_tokens: int, reason: PageReason) -> list[int]:
        """Give the request blocks for ``num_tokens`` tokens, allocating fresh private
        (zeroed) pages for ``reason``; returns the new block ids (raises, allocating nothing,
        when the pool is short)."""
        state = self.request(request_id)
        needed = self.blocks_for_tokens(num_tokens) - len(state.block_ids)
        if needed <= 0:
            return []
        new = self.pool.allocate(needed, reason)
        state.block_ids.extend(new)
        return new

    def pause_request(self, request_id: Hashable) -> None:
        """Keep the request's blocks but leave it out of steps until :meth:`resume_request`."""
        self.request(request_id).paused = True

    def resume_request(self, request_id: Hashable) -> list[int]:
        """Resume a paused request, allocating (reason ``resume``) the blocks its next
        tokens need; stays paused if the pool is short."""
        state = self.request(request_id)
        new = self.ensure_token_capacity(request_id, len(state.tokens), PageReason.RESUME)
        state.paused = False
        return new

    def release_request(self, request_id: Hashable) -> BlockHashChain:
        """Drop a finished or evicted request: free its blocks (cached ones stay cached until
        evicted) and its Mamba slot. Returns its hash chain for a later re-admission."""
        if self.step is not None and request_id in self.step.request_ids:
            raise StepError(f"request {request_id!r} is in the step being run; commit the step first")
        state = self.request(request_id)
        self.pool.free(state.block_ids)
        if state.mamba_slot is not None:
            self.mamba_slots.free(state.mamba_slot)
        del self._requests[request_id]
        return state.hash_chain

    def detach_request(self, request_id: Hashable) -> RequestState:
        """Take a request out of the context (it no longer counts as one of its requests) while
        its blocks stay referenced and its Mamba slot stays held: a handoff pin whose storage
        another engine reads, or storage a transfer may still write. Give the storage back with
        :meth:`release_detached`."""
        if self.step is not None and request_id in self.step.request_ids:
            raise StepError(f"request {request_id!r} is in the step being run; commit the step first")
        state = self.request(request_id)
        del self._requests[request_id]
        return state

    def release_detached(self, state: RequestState) -> None:
        """Free the blocks and Mamba slot of a request taken out by :meth:`detach_request`."""
        self.pool.free(state.block_ids)
        if state.mamba_slot is not None:
            self.mamba_slots.free(state.mamba_slot)

    # ---- step ------------------------------------------------------------------------------
    def build_step(self, schedule: Sequence[tuple[Hashable, int]], *, pad_to_tokens: int | None = None) -> StepBatch:
        """Pack ``(request_id, num_new_tokens)`` entries into this step's :class:`StepBatch`
        (also kept as ``self.step`` for the hooks). Each request's next uncomputed tokens are
        taken; its blocks must already cover them."""
        if self.step is not None:
            raise StepError("the previous step was not committed; call commit_step() first")
        bs = self.block_size
        ids, token_ids, positions, slots, q_lens, offsets, tables, mamba_slots = [], [], [], [], [], [], [], []
        seen = set()
        for request_id, num_new in schedule:
            state = self.request(request_id)
            start = state.num_computed_tokens
            problem = (
                "appears twice"
                if request_id in seen
                else "is paused"
                if state.paused
                else f"asks for {num_new} new tokens but has {len(state.tokens) - start} uncomputed"
                if not 1 <= num_new <= len(state.tokens) - start
                else f"has blocks for {len(state.block_ids) * bs} tokens, needs {start + num_new} "
                f"(call ensure_token_capacity first)"
                if len(state.block_ids) * bs < start + num_new
                else None
            )
            if problem:
                raise StepError(f"request {request_id!r} {problem}")
            ids.append(request_id)
            seen.add(request_id)
            blocks = state.block_ids
            token_ids.extend(state.tokens[start : start + num_new])
            positions.extend(range(start, start + num_new))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + num_new))
            q_lens.append(num_new)
            offsets.append(start)
            tables.append(blocks[: self.blocks_for_tokens(start + num_new)])
            mamba_slots.append(state.mamba_slot)
        num_tokens = sum(q_lens)
        if num_tokens > self.max_tokens_per_step:
            raise StepError(f"step has {num_tokens} tokens, more than max_tokens_per_step={self.max_tokens_per_step}")
        padded = num_tokens if pad_to_tokens is None else pad_to_tokens
        if padded < num_tokens:
            raise StepError(f"pad_to_tokens={pad_to_tokens} is less than the step's {num_tokens} tokens")
        dummy = self.pool.dummy_block_id
        pad = padded - num_tokens
        width = max((len(t) for t in tables), default=0)
        table = torch.tensor([t + [dummy] * (width - len(t)) for t in tables], dtype=torch.long).reshape(
            len(ids), width
        )
        q_len_tensor = torch.tensor(q_lens, dtype=torch.long)
        offset_tensor = torch.tensor(offsets, dtype=torch.long)
        device = self.device
        self.step = StepBatch(
            request_ids=tuple(ids),
            token_ids=torch.tensor(token_ids + [0] * pad, dtype=torch.long, device=device),
            positions=torch.tensor(positions + [0] * pad, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(
                slots + [dummy * bs + i % bs for i in range(pad)], dtype=torch.long, device=device
            ),
            query_lengths=q_len_tensor.to(device),
            cu_query_lengths=torch.cat([torch.zeros(1, dtype=torch.long), q_len_tensor.cumsum(0)]).to(device),
            kv_offsets=offset_tensor.to(device),
            kv_lengths=(offset_tensor + q_len_tensor).to(device),
            block_tables=table.to(device),
            mamba_slot_ids=torch.tensor(
                mamba_slots if self.mamba_slots is not None else [], dtype=torch.long, device=device
            ),
            num_tokens=num_tokens,
        )
        return self.step

    def store_kv_and_attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention hook (see module doc): store this step's ``k, v [T, 1, kv_heads, d]`` of
        global layer ``layer_number`` in the paged cache, return the paged attention of
        ``q [T, 1, q_heads, d]`` as ``[T, 1, q_heads, d]``."""
        step = self._require_step()
        layer_index = self._layer_index(self._attention_index, layer_number, "attention")
        expected = (step.num_padded_tokens, 1)
        if q.shape[:2] != expected or k.shape[:2] != expected or v.shape[:2] != expected:
            raise StepError(
                f"attention hook takes q, k, v of shape [T={expected[0]}, 1, heads, dim] for this step, got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        self.kv_cache.store(layer_index, step.slot_mapping, k[:, 0], v[:, 0])
        key_cache, value_cache = self.kv_cache.layer(layer_index)
        out = torch.zeros_like(q)
        out[: step.num_tokens, 0] = paged_attention(
            q[: step.num_tokens, 0],
            key_cache,
            value_cache,
            step.block_tables,
            step.query_lengths,
            step.kv_lengths,
            self.softmax_scale,
            validate=False,  # build_step made the lengths consistent; checking reads them on the host
        )
        return out

    def is_decode_only(self) -> bool:
        """Whether every request of the current step has exactly one new token."""
        return bool((self._require_step().query_lengths == 1).all())

    def mamba_states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mamba hook (see module doc): this layer's ``(conv [R, ...], ssm [R, ...])`` for the
        step's requests in batch order, to update in place; written back at commit_step."""
        step = self._require_step()
        layer_index = self._layer_index(self._mamba_index, layer_number, "Mamba")
        if layer_index not in self._step_mamba_states:
            self._step_mamba_states[layer_index] = self.mamba_slots.gather(layer_index, step.mamba_slot_ids)
        return self._step_mamba_states[layer_index]

    def mamba_state_slots(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mamba hook for kernels that update the request slots in place (see the mixer's
        ``MambaInferenceContext``): this layer's ``conv [slots, ...]`` and ``ssm [slots, ...]``
        slot tensors and the step's slot of each request ``[R]`` (on the device). Nothing is
        written back at commit_step: a layer uses this hook or :meth:`mamba_states`, not both."""
        step = self._require_step()
        layer_index = self._layer_index(self._mamba_index, layer_number, "Mamba")
        if layer_index in self._step_mamba_states:
            raise StepError(f"layer {layer_number} already took copies of its Mamba states in this step")
        return self.mamba_slots.conv[layer_index], self.mamba_slots.ssm[layer_index], step.mamba_slot_ids

    def commit_step(self) -> None:
        """The step's forward finished: write Mamba states back, mark its tokens computed,
        register newly full blocks in the prefix cache and snapshot Mamba state at block ends."""
        step = self._require_step()
        for layer_index, (conv, ssm) in self._step_mamba_states.items():
            self.mamba_slots.scatter(layer_index, step.mamba_slot_ids, conv, ssm)
        self._step_mamba_states.clear()
        self.step = None
        for request_id, num_new in zip(step.request_ids, step.query_lengths.tolist(), strict=True):
            state = self._requests[request_id]
            state.num_computed_tokens += num_new
            if self.enable_prefix_caching:
                state.hash_chain.extend(state.confirmed_tokens)
                self._register_computed_blocks(state)
                self._snapshot_mamba_state(state)

    def _register_computed_blocks(self, state: RequestState) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(state.num_computed_tokens // self.block_size, len(state.hash_chain.hashes))
        while not state.registration_deferred and state.num_registered_blocks < num_full:
            index = state.num_registered_blocks
            parent = state.block_ids[index - 1] if index else NO_BLOCK
            if self.pool.register(state.block_ids[index], state.hash_chain.hashes[index], parent):
                state.num_registered_blocks += 1
            else:
                state.registration_deferred = True
                self.num_deferred_registrations += 1

    def _snapshot_mamba_state(self, state: RequestState) -> None:
        num_blocks, rest = divmod(state.num_computed_tokens, self.block_size)
        if self.mamba_snapshots is None or rest or not num_blocks or num_blocks > len(state.hash_chain.hashes):
            return
        self.mamba_snapshots.save(state.hash_chain.hashes[num_blocks - 1], self.mamba_slots, state.mamba_slot)

    # ---- internals -------------------------------------------------------------------------
    def _init_private_pages(self, block_ids: list[int]) -> None:
        """The one place fresh private pages are initialized (called by the block pool)."""
        if not self._skip_private_page_init_for_tests:
            self.kv_cache.zero_blocks(block_ids)

    def _require_step(self) -> StepBatch:
        if self.step is None:
            raise StepError("no step is being run; call build_step() before the model's forward")
        return self.step

    @staticmethod
    def _layer_index(index: dict[int, int], layer_number: int, kind: str) -> int:
        if layer_number not in index:
            raise LayerNotOnStageError(
                f"layer {layer_number} is not a {kind} layer of this stage; its {kind} layers are {sorted(index)}"
            )
        return index[layer_number]
