"""Sizing of the inference cache of one pipeline stage, and the agreement between stages.

:func:`plan_stage_capacity` turns a memory budget (or explicit counts) into this stage's
numbers: KV blocks, Mamba slots, max concurrent requests. A stage that holds no attention
layers, no Mamba layers, or no explicit request cap contributes :data:`NEUTRAL` (maximal) for
that number. :func:`plan_capacity` then has every pipeline stage join one MIN all-reduce over
``pg_collection.pp`` in the same order (whether or not it holds Mamba layers), so all stages
size their bookkeeping identically; stages without Mamba layers allocate no Mamba buffers.
Whether the model is hybrid is a property of the whole model, passed in on every stage.

Mamba budget. On a stage with Mamba layers the Mamba part of the budget is, in this order of
precedence: ``mamba_budget_bytes``; ``mamba_memory_ratio * buffer_size_bytes``;
``max_requests`` slots' worth when only a request cap is given; otherwise
``DEFAULT_MAMBA_MEMORY_RATIO * buffer_size_bytes``. With prefix caching each request's Mamba
share also reserves a snapshot entry and an extraction scratch row inside that budget. The KV
part is what remains (the dummy block included), unless ``num_blocks`` is explicit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core.config import TransformerConfig
from megatron.core.inference.contexts.errors import (
    CapacityError,
    CapacityNegotiationTimeoutError,
    InferenceContextError,
)
from megatron.core.inference.contexts.mamba_slots import MambaStateShapes
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection

NEUTRAL = 2**62  # what a stage contributes for a resource it does not hold
DEFAULT_MAMBA_MEMORY_RATIO = 0.5
# With prefix caching, one request's Mamba share is its slot, a snapshot entry, and a scratch
# row kept free for extracting the state at a block boundary inside a prefill chunk (fast
# kernels return chunk states; the torch path snapshots at block-aligned step ends instead).
MAMBA_ROWS_PER_REQUEST_WITH_PREFIX_CACHING = 3


@dataclass(frozen=True)
class StageCacheSpec:
    """What this pipeline stage stores: its attention and Mamba layers (global 1-based
    numbers) and the per-token / per-request sizes (TP-local)."""

    attention_layer_numbers: tuple[int, ...]
    mamba_layer_numbers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: torch.dtype = torch.float32
    mamba_shapes: MambaStateShapes | None = None

    def __post_init__(self):
        object.__setattr__(self, "attention_layer_numbers", tuple(self.attention_layer_numbers))
        object.__setattr__(self, "mamba_layer_numbers", tuple(self.mamba_layer_numbers))
        numbers = self.attention_layer_numbers + self.mamba_layer_numbers
        if any(n < 1 for n in numbers) or len(set(numbers)) != len(numbers):
            raise InferenceContextError(
                f"layer numbers must be distinct global 1-based numbers; got attention "
                f"{self.attention_layer_numbers}, Mamba {self.mamba_layer_numbers}"
            )
        if self.block_size < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
            raise InferenceContextError(
                f"block_size, num_kv_heads and head_dim must be >= 1, got {self.block_size}, "
                f"{self.num_kv_heads}, {self.head_dim}"
            )
        if self.mamba_layer_numbers and self.mamba_shapes is None:
            raise InferenceContextError("a stage with Mamba layers needs mamba_shapes (conv and SSM state shapes)")

    @classmethod
    def from_config(
        cls,
        config: TransformerConfig,
        attention_layer_numbers,
        mamba_layer_numbers,
        block_size: int,
        tp_size: int,
    ) -> StageCacheSpec:
        """Spec of a stage of a model built from ``config`` (KV heads = query groups / TP,
        head dim = kv_channels; under multi-latent attention every head's key and value,
        :func:`~megatron.core.transformer.mla.mla_padded_head_dim` wide; Mamba shapes from the
        mixer's ``MambaDims``)."""
        shapes = None
        if mamba_layer_numbers:
            from megatron.core.ssm.mamba_mixer import MambaDims

            dims = MambaDims.from_config(config, tp_size)
            shapes = MambaStateShapes(dims.conv_state_shape(), dims.ssm_state_shape(), config.params_dtype)
        heads, head_dim = config.num_query_groups, config.kv_channels
        if config.multi_latent_attention:
            from megatron.core.transformer.mla import mla_padded_head_dim

            heads, head_dim = config.num_attention_heads, mla_padded_head_dim(config)
        return cls(
            tuple(attention_layer_numbers),
            tuple(mamba_layer_numbers),
            heads // tp_size,
            head_dim,
            block_size,
            config.params_dtype,
            shapes,
        )

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * len(self.attention_layer_numbers) * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_mamba_slot(self) -> int:
        return len(self.mamba_layer_numbers) * self.mamba_shapes.bytes_per_layer if self.mamba_layer_numbers else 0


@dataclass(frozen=True)
class CapacityConfig:
    """How to size the cache; see the module doc for the Mamba budget rules."""

    buffer_size_bytes: int | None = None
    num_blocks: int | None = None
    max_requests: int | None = None
    mamba_memory_ratio: float | None = None
    mamba_budget_bytes: int | None = None

    def __post_init__(self):
        for name in ("buffer_size_bytes", "num_blocks", "max_requests", "mamba_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InferenceContextError(f"{name} must be a positive integer or None, got {value!r}")
        ratio = self.mamba_memory_ratio
        if ratio is not None and not 0 < ratio < 1:
            raise InferenceContextError(f"mamba_memory_ratio must be in (0, 1), got {ratio!r}")
        if ratio is not None and self.mamba_budget_bytes is not None:
            raise InferenceContextError("give mamba_memory_ratio or mamba_budget_bytes, not both")
        if ratio is not None and self.buffer_size_bytes is None:
            raise InferenceContextError("mamba_memory_ratio needs buffer_size_bytes (the budget it is a share of)")


@dataclass(frozen=True)
class StageCapacity:
    """One stage's own numbers before negotiation (NEUTRAL where it holds no such resource)."""

    num_blocks: int
    num_mamba_slots: int
    max_requests: int
    fits_one_request: bool
    reason: str = ""


@dataclass(frozen=True)
class Capacity:
    """The agreed numbers every stage sizes its context with.

    ``num_blocks`` usable KV blocks (the dummy block comes on top); ``num_mamba_slots`` equals
    ``max_requests`` for hybrid models, 0 otherwise; ``num_mamba_snapshots`` prefix-cache
    snapshot entries (hybrid models with prefix caching), 0 otherwise.
    """

    num_blocks: int
    max_requests: int
    num_mamba_slots: int = 0
    num_mamba_snapshots: int = 0


def plan_stage_capacity(
    spec: StageCacheSpec,
    config: CapacityConfig,
    *,
    max_sequence_length: int,
    enable_prefix_caching: bool,
) -> StageCapacity:
    """This stage's blocks / Mamba slots / max requests from its budget (no communication)."""
    mamba_bytes = 0
    num_slots = NEUTRAL
    if spec.mamba_layer_numbers:
        rows = MAMBA_ROWS_PER_REQUEST_WITH_PREFIX_CACHING if enable_prefix_caching else 1
        bytes_per_request = spec.bytes_per_mamba_slot * rows
        if config.mamba_budget_bytes is not None:
            mamba_bytes = config.mamba_budget_bytes
        elif config.mamba_memory_ratio is not None:
            mamba_bytes = int(config.mamba_memory_ratio * config.buffer_size_bytes)
        elif config.max_requests is not None and config.buffer_size_bytes is None:
            mamba_bytes = config.max_requests * bytes_per_request
        elif config.buffer_size_bytes is not None:
            mamba_bytes = int(DEFAULT_MAMBA_MEMORY_RATIO * config.buffer_size_bytes)
        else:
            raise InferenceContextError(
                "a stage with Mamba layers needs buffer_size_bytes, mamba_budget_bytes or max_requests to size "
                "its state"
            )
        num_slots = mamba_bytes // bytes_per_request
    num_blocks = NEUTRAL
    if spec.attention_layer_numbers:
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif config.buffer_size_bytes is not None:
            num_blocks = max((config.buffer_size_bytes - mamba_bytes) // spec.bytes_per_block - 1, 0)
        else:
            raise InferenceContextError("a stage with attention layers needs buffer_size_bytes or num_blocks")
    max_requests = min(config.max_requests or NEUTRAL, num_slots)
    blocks_per_request = math.ceil(max_sequence_length / spec.block_size)
    problems = []
    if num_blocks < blocks_per_request:
        problems.append(
            f"{num_blocks} KV blocks, but one request of max_sequence_length {max_sequence_length} needs "
            f"{blocks_per_request} blocks of {spec.block_size} tokens ({spec.bytes_per_block} bytes each)"
        )
    if num_slots < 1:
        rows = MAMBA_ROWS_PER_REQUEST_WITH_PREFIX_CACHING if enable_prefix_caching else 1
        problems.append(
            f"{mamba_bytes} bytes of Mamba budget, but one request's Mamba state needs "
            f"{spec.bytes_per_mamba_slot * rows} bytes"
        )
    return StageCapacity(num_blocks, num_slots, max_requests, not problems, "; ".join(problems))


def plan_capacity(
    spec: StageCacheSpec,
    config: CapacityConfig,
    *,
    max_sequence_length: int,
    is_hybrid_model: bool,
    enable_prefix_caching: bool,
    pg_collection: ProcessGroupCollection | None = None,
    timeout_s: float = 60.0,
) -> Capacity:
    """Size this stage, agree with every other pipeline stage (MIN over ``pg_collection.pp``)
    and return the common :class:`Capacity`.

    Every stage must call this, in the same order relative to its other collectives. A stage
    that cannot size its cache (settings it cannot use, or a budget that cannot fit one
    request) still joins the negotiation and shares its reason through it: every stage then
    raises the same CapacityError naming the lowest such stage and its reason. Raises
    CapacityNegotiationTimeoutError when the stages do not all join within ``timeout_s``.
    """
    pp_group = resolve_pg_collection(pg_collection).pp
    stage = dist.get_rank(pp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pp_group) == "nccl" else None
    local, problem = _plan_this_stage(
        spec,
        config,
        max_sequence_length=max_sequence_length,
        is_hybrid_model=is_hybrid_model,
        enable_prefix_caching=enable_prefix_caching,
    )
    values = torch.tensor(
        [local.num_blocks, local.num_mamba_slots, local.max_requests, NEUTRAL if problem is None else stage],
        dtype=torch.int64,
        device=device,
    )
    shared = dist.get_world_size(pp_group) > 1
    if shared:
        work = dist.all_reduce(values, op=dist.ReduceOp.MIN, group=pp_group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as err:
            raise CapacityNegotiationTimeoutError(
                f"stage {stage}: not every pipeline stage joined the capacity negotiation within "
                f"{timeout_s:g}s ({err}); every stage must create its inference context"
            ) from err
    num_blocks, num_slots, max_requests, limiting_stage = (int(v) for v in values.tolist())
    if limiting_stage != NEUTRAL:
        if shared:  # every stage learns the limiting stage's reason (all of them join this too)
            problem = _broadcast_text(problem if limiting_stage == stage else "", limiting_stage, pp_group, device)
        where = "this stage" if limiting_stage == stage else f"a remote stage; this is stage {stage}"
        raise CapacityError(f"pipeline stage {limiting_stage} ({where}) {problem}", limiting_stage=limiting_stage)
    return _finalize(
        num_blocks,
        num_slots,
        max_requests,
        max_sequence_length,
        spec.block_size,
        is_hybrid_model,
        enable_prefix_caching,
    )


def _plan_this_stage(
    spec: StageCacheSpec,
    config: CapacityConfig,
    *,
    max_sequence_length: int,
    is_hybrid_model: bool,
    enable_prefix_caching: bool,
) -> tuple[StageCapacity, str | None]:
    """This stage's numbers and, when it cannot size its cache, why (a sentence saying what to
    change); a stage with a problem contributes NEUTRAL numbers."""
    try:
        if spec.mamba_layer_numbers and not is_hybrid_model:
            raise InferenceContextError("this stage holds Mamba layers but is_hybrid_model is False")
        local = plan_stage_capacity(
            spec, config, max_sequence_length=max_sequence_length, enable_prefix_caching=enable_prefix_caching
        )
    except InferenceContextError as err:
        return StageCapacity(NEUTRAL, NEUTRAL, NEUTRAL, False, str(err)), f"cannot size its inference cache: {err}"
    if not local.fits_one_request:
        return local, (
            f"cannot fit the state of one request: {local.reason}; raise the memory budget or lower max_sequence_length"
        )
    return local, None


def _broadcast_text(text: str, src_stage: int, group: dist.ProcessGroup, device) -> str:
    """``text`` of stage ``src_stage``, on every stage of ``group`` (collective; UTF-8 bytes)."""
    src = dist.get_global_rank(group, src_stage)
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src, group=group)
    return buffer.cpu().numpy().tobytes().decode()


def _finalize(num_blocks, num_slots, max_requests, max_sequence_length, block_size, is_hybrid, prefix_caching):
    """Resolve the NEUTRAL values left after negotiation into the final :class:`Capacity`."""
    if is_hybrid:
        max_requests = min(max_requests, num_slots)
    if num_blocks == NEUTRAL:
        if max_requests == NEUTRAL:
            raise CapacityError("the model has neither attention nor Mamba layers to size a cache for")
        # No attention anywhere: blocks only track tokens (no KV bytes behind them).
        num_blocks = max_requests * math.ceil(max_sequence_length / block_size)
    if max_requests == NEUTRAL:
        max_requests = num_blocks  # every request holds at least one block
    num_slots = max_requests if is_hybrid else 0
    return Capacity(num_blocks, max_requests, num_slots, num_slots if is_hybrid and prefix_caching else 0)
