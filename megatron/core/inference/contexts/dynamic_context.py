"""The dynamic inference context of one pipeline stage: paged KV cache, block pool with
prefix caching, Mamba state slots, and the per-step batch the model runs on.

Request lifecycle (called by the engine; every call is all-or-nothing):

* :meth:`~DynamicInferenceContext.check_admission` — the typed admission errors of
  :mod:`errors` (also run by ``add_request`` / ``import_request``).
* :meth:`~DynamicInferenceContext.add_request` — shares the longest cached prefix of the prompt,
  allocates private blocks for the rest (reason ``admission``), and a Mamba slot, zeroed or
  restored from the snapshot of the last shared block.
* :meth:`~DynamicInferenceContext.append_tokens` — record sampled tokens.
* :meth:`~DynamicInferenceContext.append_pending_token` /
  :meth:`~DynamicInferenceContext.resolve_pending_token` — overlapped steps: the next step is
  built while the token it continues from is still being sampled on the device; a pending
  token is read there from the previous step's sampled tokens, and is never hashed or cached
  until resolved.
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
   so activations are ``[T, 1, h]``. Padding tokens write K/V to the dummy block. The batch's
   tensors are views of preallocated buffers (:mod:`step_buffers`); ``pad_to_requests`` also
   pads the request rows (the static-buffer / CUDA-graph steps): in a decode step each padding
   request has one token, attends the dummy block and uses the scratch Mamba slot; in a mixed
   step (``padding_request_tokens=0``) padding requests have no token and change nothing.
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

import contextlib
import itertools
import math
from collections.abc import Hashable, Iterator, Sequence
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
from megatron.core.inference.contexts.prefix_cache import BlockHashChain
from megatron.core.inference.contexts.step_attention import AttentionWorkspace, StepAttention
from megatron.core.inference.contexts.step_buffers import StepBuffers
from megatron.core.inference.host_copies import to_device
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
    # Row of this request in the context's block tables.
    table_row: int = -1
    # Overlapped steps: the last token is still being sampled (append_pending_token); its value
    # is read on the device from row pending_source_row of the previous step's sampled tokens.
    num_pending_tokens: int = 0
    pending_source_row: int = -1

    @property
    def confirmed_tokens(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.num_draft_tokens - self.num_pending_tokens]


@dataclass(frozen=True)
class StepBatch:
    """The metadata of one forward step (``R`` request rows, ``T`` padded tokens).

    The tensors live on the context's device (views of its step buffers); the ``host_*`` fields
    and ``decode_only`` are the same facts on the host, so nothing needs reading back. With
    ``pad_to_requests`` the rows past the real requests are padding requests.
    """

    request_ids: tuple  # the real requests, in row order
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], 0 for padding
    slot_mapping: torch.Tensor  # [T], cache slot of each token; padding -> dummy block
    token_requests: torch.Tensor  # [T], request row of each token (padding tokens: row 0)
    query_lengths: torch.Tensor  # [R]
    cu_query_lengths: torch.Tensor  # [R + 1]
    kv_offsets: torch.Tensor  # [R], tokens already cached before this step
    kv_lengths: torch.Tensor  # [R], kv_offsets + query_lengths
    block_tables: torch.Tensor  # [R, max_blocks], padded with the dummy block
    mamba_slot_ids: torch.Tensor  # [R] on stages with Mamba layers, else empty
    num_tokens: int  # tokens of request rows (real and padding requests); the rest is padding
    host_query_lengths: tuple[int, ...]  # [R]
    host_kv_offsets: tuple[int, ...]  # [R]
    decode_only: bool  # every row has exactly one new token
    # Row counts at which the per-row kernels give every row the bits they give at T (the engine's
    # checked step buckets): a kernel run over part of the step's rows may pad them to the
    # smallest that holds them. Empty: to T.
    row_buckets: tuple[int, ...] = ()

    @property
    def num_padded_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        """Request rows, padding requests included."""
        return len(self.host_query_lengths)


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
        self._deferred_page_ids: list[int] | None = None  # inside batched_page_init()
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
        self._step_attention: StepAttention | None = None
        self._attention_workspace = AttentionWorkspace()
        self._step_mamba_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_deferred_registrations = 0
        # Block tables: one row per request (its blocks, then the dummy block), kept on the host
        # and updated as blocks come; the last row (all dummy) serves padding requests.
        self.max_blocks_per_request = self.blocks_for_tokens(max_sequence_length)
        rows = capacity.max_requests
        self._host_tables = torch.full((rows + 1, self.max_blocks_per_request), self.pool.dummy_block_id)
        self._padding_row = rows
        self._free_rows = list(range(rows - 1, -1, -1))
        # A step has at most max_tokens_per_step request rows (padding requests included).
        self.step_buffers = StepBuffers(
            max_tokens_per_step, max_tokens_per_step, self.max_blocks_per_request, self.device
        )

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

    def storage_counts(self) -> dict[str, int]:
        """Free and total KV blocks and Mamba slots (slots 0 and 0 without Mamba layers)."""
        slots = self.mamba_slots
        return dict(
            free_blocks=self.num_free_blocks,
            num_blocks=self.capacity.num_blocks,
            free_mamba_slots=slots.num_free_slots if slots is not None else 0,
            num_mamba_slots=slots.num_slots if slots is not None else 0,
        )

    @staticmethod
    def storage_all_free(counts: dict[str, int]) -> bool:
        """Whether :meth:`storage_counts` ``counts`` say every block and Mamba slot is free."""
        return counts["free_blocks"] == counts["num_blocks"] and counts["free_mamba_slots"] == counts["num_mamba_slots"]

    @property
    def private_page_init_counts(self):
        """Fresh private pages initialized so far, per :class:`PageReason` value."""
        return self.pool.private_page_init_counts

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def find(self, request_id: Hashable) -> RequestState | None:
        """The request's state, or None when it is not in the context."""
        return self._requests.get(request_id)

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
            request_id,
            tokens,
            chain,
            block_ids,
            len(cached) * self.block_size,
            slot,
            num_registered_blocks=len(cached),
            table_row=self._free_rows.pop(),
        )
        self._host_tables[state.table_row] = self.pool.dummy_block_id
        self._write_table(state, 0)
        self._requests[request_id] = state
        return state

    def _write_table(self, state: RequestState, first: int) -> None:
        """Copy the request's blocks from index ``first`` on into its block-table row."""
        if len(state.block_ids) > first:
            self._host_tables.numpy()[state.table_row, first : len(state.block_ids)] = state.block_ids[first:]

    def _forget(self, state: RequestState) -> None:
        """Drop a request from the context's books (its storage is the caller's)."""
        del self._requests[state.request_id]
        self._free_rows.append(state.table_row)

    # ---- growth and release ----------------------------------------------------------------
    def append_tokens(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Record tokens sampled for a request (their KV is computed by a later step)."""
        self.request(request_id).tokens.extend(tokens)

    def append_pending_token(self, request_id: Hashable, source_row: int) -> None:
        """Overlapped steps: the request's next token is being sampled by a step in flight, at row
        ``source_row`` of its sampled tokens. It takes its place in the request (a step built now
        reads it from there on the device, see ``build_step``) until :meth:`resolve_pending_token`."""
        state = self.request(request_id)
        if state.num_pending_tokens or state.num_draft_tokens:
            raise StepError(f"request {request_id!r} already has a pending or draft token")
        state.tokens.append(0)
        state.num_pending_tokens = 1
        state.pending_source_row = source_row

    def resolve_pending_token(self, request_id: Hashable, token: int) -> None:
        """The pending token of the request came back: record it; blocks it completes may now be
        cached (and Mamba state snapshot at their end)."""
        state = self.request(request_id)
        if not state.num_pending_tokens:
            raise StepError(f"request {request_id!r} has no pending token")
        state.tokens[-1] = token
        state.num_pending_tokens = 0
        state.pending_source_row = -1
        if self.enable_prefix_caching:
            state.hash_chain.extend(state.confirmed_tokens)
            self._register_computed_blocks(state)
            self._snapshot_mamba_state(state)

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
            # The chain covers the confirmed tokens, as everywhere: with overlapped steps it may
            # already hash a resolved token whose KV a step has yet to compute.
            state.hash_chain.extend(state.confirmed_tokens)
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
        self._write_table(state, len(state.block_ids) - len(new))
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
        self._forget(state)
        return state.hash_chain

    def detach_request(self, request_id: Hashable) -> RequestState:
        """Take a request out of the context (it no longer counts as one of its requests) while
        its blocks stay referenced and its Mamba slot stays held: a handoff pin whose storage
        another engine reads, or storage a transfer may still write. Give the storage back with
        :meth:`release_detached`."""
        if self.step is not None and request_id in self.step.request_ids:
            raise StepError(f"request {request_id!r} is in the step being run; commit the step first")
        state = self.request(request_id)
        self._forget(state)
        return state

    def release_detached(self, state: RequestState) -> None:
        """Free the blocks and Mamba slot of a request taken out by :meth:`detach_request`."""
        self.pool.free(state.block_ids)
        if state.mamba_slot is not None:
            self.mamba_slots.free(state.mamba_slot)

    # ---- step ------------------------------------------------------------------------------
    def build_step(
        self,
        schedule: Sequence[tuple[Hashable, int]],
        *,
        pad_to_tokens: int | None = None,
        pad_to_requests: int | None = None,
        padding_request_tokens: int = 1,
        pending_tokens: torch.Tensor | None = None,
        row_buckets: Sequence[int] = (),
    ) -> StepBatch:
        """Pack ``(request_id, num_new_tokens)`` entries into this step's :class:`StepBatch`
        (also kept as ``self.step`` for the hooks). Each request's next uncomputed tokens are
        taken; its blocks must already cover them.

        Args:
            pad_to_tokens: pad the packed tokens to this many (padding writes to the dummy block).
            pad_to_requests: pad the request rows to this many (the static-buffer steps of the CUDA
                graphs, whose block tables are then full rows), each padding request of
                ``padding_request_tokens`` tokens: 1 (a decode-only step, whose tokens must then hold
                every row's token) or 0 (any step).
            pending_tokens: the device tensor a step in flight samples into; a request's pending
                token (:meth:`append_pending_token`) is read from it on the device.
            row_buckets: the step's :attr:`StepBatch.row_buckets` (sorted).
        """
        if self.step is not None:
            raise StepError("the previous step was not committed; call commit_step() first")
        bs = self.block_size
        ids, token_ids, positions, slots, q_lens, offsets, rows, mamba_slots = [], [], [], [], [], [], [], []
        pending_targets, pending_sources = [], []
        for request_id, num_new in schedule:
            state = self.request(request_id)
            start = state.num_computed_tokens
            tokens = state.tokens
            blocks = state.block_ids
            end = start + num_new
            problem = (
                "is paused"
                if state.paused
                else f"asks for {num_new} new tokens but has {len(tokens) - start} uncomputed"
                if not 1 <= num_new <= len(tokens) - start
                else f"has blocks for {len(blocks) * bs} tokens, needs {end} (call ensure_token_capacity first)"
                if len(blocks) * bs < end
                else None
            )
            if problem:
                raise StepError(f"request {request_id!r} {problem}")
            ids.append(request_id)
            if state.num_pending_tokens and end == len(tokens):
                if pending_tokens is None:
                    raise StepError(f"request {request_id!r} has a pending token but no pending_tokens were given")
                pending_targets.append(len(token_ids) + num_new - 1)
                pending_sources.append(state.pending_source_row)
            if num_new == 1:  # decode: one token
                token_ids.append(tokens[start])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                token_ids += tokens[start:end]
                positions += range(start, end)
                slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            q_lens.append(num_new)
            offsets.append(start)
            rows.append(state.table_row)
            mamba_slots.append(state.mamba_slot)
        if len(set(ids)) < len(ids):
            twice = next(request_id for index, request_id in enumerate(ids) if request_id in ids[:index])
            raise StepError(f"request {twice!r} appears twice")
        num_tokens = sum(q_lens)
        if num_tokens > self.max_tokens_per_step:
            raise StepError(f"step has {num_tokens} tokens, more than max_tokens_per_step={self.max_tokens_per_step}")
        dummy = self.pool.dummy_block_id
        num_real = len(ids)
        if pad_to_requests is not None:
            extra = pad_to_requests - num_real
            if padding_request_tokens not in (0, 1):
                raise StepError(f"padding_request_tokens must be 0 or 1, got {padding_request_tokens}")
            if extra < 0 or pad_to_tokens is None or num_tokens + extra * padding_request_tokens > pad_to_tokens:
                raise StepError(
                    f"pad_to_requests={pad_to_requests} pads {num_real} requests of {num_tokens} tokens with padding "
                    f"requests of {padding_request_tokens} token(s), which must fit pad_to_tokens={pad_to_tokens}"
                )
            if padding_request_tokens and num_tokens != num_real:
                raise StepError("padding requests of one token pad a decode-only step (one token per request)")
            if pad_to_requests > self.step_buffers.max_requests:
                raise StepError(f"pad_to_requests={pad_to_requests} exceeds {self.step_buffers.max_requests} step rows")
            scratch = self.mamba_slots.scratch_slot if self.mamba_slots is not None else None
            padding = extra * padding_request_tokens
            token_ids += [0] * padding
            positions += [0] * padding
            slots += [dummy * bs + i % bs for i in range(padding)]
            q_lens += [padding_request_tokens] * extra
            offsets += [0] * extra
            rows += [self._padding_row] * extra
            mamba_slots += [scratch] * extra
            num_tokens += padding
        padded = num_tokens if pad_to_tokens is None else pad_to_tokens
        if padded < num_tokens:
            raise StepError(f"pad_to_tokens={pad_to_tokens} is less than the step's {num_tokens} tokens")
        pad = padded - num_tokens
        num_rows = len(q_lens)
        buffers = self.step_buffers
        staging = buffers.host_staging()
        token_requests = [row for row, length in enumerate(q_lens) for _ in range(length)]
        kv_lengths = [o + n for o, n in zip(offsets, q_lens, strict=True)]
        fields = dict(
            token_ids=token_ids + [0] * pad,
            positions=positions + [0] * pad,
            slot_mapping=slots + [dummy * bs + i % bs for i in range(pad)],
            token_requests=token_requests + [0] * pad,
            query_lengths=q_lens,
            kv_offsets=offsets,
            kv_lengths=kv_lengths,
            cu_query_lengths=[0, *itertools.accumulate(q_lens)],
            mamba_slot_ids=mamba_slots if self.mamba_slots is not None else [],
        )
        buffers.fill(staging, fields)
        # Full rows: a CUDA graph reads [rows, max_blocks]; entries past a request's blocks are the dummy.
        host_tables = buffers.block_tables(staging, num_rows, buffers.max_blocks)
        host_tables.numpy()[:] = self._host_tables.numpy()[rows]
        buffers.upload(staging, num_rows)
        device = buffers.buffer
        width = (
            buffers.max_blocks
            if pad_to_requests is not None
            else self.blocks_for_tokens(max(kv_lengths, default=0))  # the longest row's blocks
        )
        token_ids_view = buffers.field(device, "token_ids", padded)
        num_pending = len(pending_targets)
        if num_pending and pending_targets[-1] == num_pending - 1 and pending_sources == pending_targets:
            # Rows 0..n-1 (the targets increase) take sampled tokens 0..n-1, as in a steady decode batch: one copy.
            token_ids_view[:num_pending].copy_(pending_tokens[:num_pending])
        elif num_pending:
            pending_index = to_device(torch.tensor(pending_targets + pending_sources), self.device)  # one copy
            token_ids_view.index_copy_(
                0, pending_index[:num_pending], pending_tokens.index_select(0, pending_index[num_pending:])
            )
        self.step = StepBatch(
            request_ids=tuple(ids),
            token_ids=token_ids_view,
            positions=buffers.field(device, "positions", padded),
            slot_mapping=buffers.field(device, "slot_mapping", padded),
            token_requests=buffers.field(device, "token_requests", padded),
            query_lengths=buffers.field(device, "query_lengths", num_rows),
            cu_query_lengths=buffers.field(device, "cu_query_lengths", num_rows + 1),
            kv_offsets=buffers.field(device, "kv_offsets", num_rows),
            kv_lengths=buffers.field(device, "kv_lengths", num_rows),
            block_tables=buffers.block_tables(device, num_rows, width),
            mamba_slot_ids=buffers.field(device, "mamba_slot_ids", num_rows if self.mamba_slots is not None else 0),
            num_tokens=num_tokens,
            host_query_lengths=tuple(q_lens),
            host_kv_offsets=tuple(offsets),
            decode_only=all(n == 1 for n in q_lens if n),  # (padding requests of no token aside)
            row_buckets=tuple(row_buckets),
        )
        if self.spec.attention_layer_numbers:
            self._step_attention = StepAttention.plan(
                self.step,
                host_tables,
                bs,
                self.device,
                self.softmax_scale,
                kv_heads=self.kv_cache.data.shape[-2],
                value_slot_offset=self.kv_cache.value_slot_offset,
                workspace=self._attention_workspace,
            )
        return self.step

    def store_kv_and_attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention hook (see module doc): store this step's ``k, v [T, 1, kv_heads, d]`` of
        global layer ``layer_number`` in the paged cache, return the paged attention of
        ``q [T, 1, q_heads, d]`` as ``[T, 1, q_heads, d]`` (zero for padding tokens)."""
        step = self._require_step()
        layer_index = self._layer_index(self._attention_index, layer_number, "attention")
        expected = (step.num_padded_tokens, 1)
        if q.shape[:2] != expected or k.shape[:2] != expected or v.shape[:2] != expected:
            raise StepError(
                f"attention hook takes q, k, v of shape [T={expected[0]}, 1, heads, dim] for this step, got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        self.kv_cache.store(layer_index, step.slot_mapping, k[:, 0], v[:, 0])
        return self._step_attention.attend(q[:, 0], self.kv_cache, layer_index)[:, None]

    def is_decode_only(self) -> bool:
        """Whether every request of the current step has exactly one new token (host-side)."""
        return self._require_step().decode_only

    def mamba_states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mamba hook (see module doc): this layer's ``(conv [R, ...], ssm [R, ...])`` for the
        step's request rows in batch order, to update in place; written back at commit_step."""
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

    def write_back_step_states(self) -> None:
        """Write the Mamba states the step's layers updated back to their slots (device work only;
        ``commit_step`` does it when it was not done already, a captured CUDA graph does it
        inside the graph)."""
        step = self._require_step()
        for layer_index, (conv, ssm) in self._step_mamba_states.items():
            self.mamba_slots.scatter(layer_index, step.mamba_slot_ids, conv, ssm)
        self._step_mamba_states.clear()

    def commit_step(self) -> None:
        """The step's forward was run (its device work is queued): write Mamba states back, mark
        its tokens computed, register newly full blocks in the prefix cache and snapshot Mamba
        state at block ends (pending tokens are neither hashed nor cached yet)."""
        self.write_back_step_states()
        step = self.step
        self.step = None
        self._step_attention = None
        for request_id, num_new in zip(step.request_ids, step.host_query_lengths[: len(step.request_ids)], strict=True):
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
    @contextlib.contextmanager
    def batched_page_init(self) -> Iterator[None]:
        """Within the block, the fresh private pages handed out are initialized together when it
        ends (one device call instead of one per allocation: the scheduler's growth of every
        request in a step). Nothing may write KV pages inside the block; nested blocks join the
        outer one."""
        if self._deferred_page_ids is not None:
            yield
            return
        self._deferred_page_ids = []
        try:
            yield
        finally:
            block_ids, self._deferred_page_ids = self._deferred_page_ids, None
            if block_ids:
                self._init_private_pages(block_ids)

    def _init_private_pages(self, block_ids: list[int]) -> None:
        """The one place fresh private pages are initialized (called by the block pool; deferred
        to the end of a :meth:`batched_page_init` block)."""
        if self._deferred_page_ids is not None:
            self._deferred_page_ids.extend(block_ids)
        elif not self._skip_private_page_init_for_tests:
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
