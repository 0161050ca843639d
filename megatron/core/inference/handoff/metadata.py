"""The handoff record: everything a decode engine needs to pull one prefilled request.

A :class:`HandoffRecord` is plain data (``to_dict`` gives msgpack-able values). It names the
request's source block ids (the same on every rank of the prefill engine, which steps in
lockstep) and their chained hashes, the resume tokens (first sampled token, then any MTP
drafts), and one :class:`SourceLayout` per prefill rank: which global layers it holds (its
pipeline stage), which KV heads (its tensor-parallel rank), the shapes of its buffers, and the
transport descriptor a peer needs to read them. Mamba state is described by
:class:`MambaStateDescriptor` (the slot and per-layer shapes) exactly when the model is hybrid.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.handoff.failures import HandoffMetadataError

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; accepted: {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class MambaStateDescriptor:
    """A rank's Mamba state buffers: ``conv [layers, slots, *conv_shape]`` and
    ``ssm [layers, slots, *ssm_shape]`` (TP-local shapes of ``tp_size`` ranks)."""

    num_slots: int
    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype: str
    ssm_dtype: str

    def row_bytes(self, which: str) -> int:
        shape, dtype = (self.conv_shape, self.conv_dtype) if which == "conv" else (self.ssm_shape, self.ssm_dtype)
        return math.prod(shape) * torch.empty((), dtype=dtype_from_name(dtype)).element_size()


@dataclass(frozen=True)
class SourceLayout:
    """What one rank's cache holds (a pipeline stage's layers, a TP rank's heads)."""

    peer: dict[str, Any]  # the transport's export (how to reach and read this rank)
    attention_layers: tuple[int, ...]  # global numbers, in the order of the KV buffer's layer axis
    mamba_layers: tuple[int, ...]
    kv_head_start: int  # global KV head range [start, stop) of this TP rank
    kv_head_stop: int
    head_dim: int
    block_size: int
    num_blocks_with_dummy: int
    kv_dtype: str
    tp_rank: int
    tp_size: int
    mamba: MambaStateDescriptor | None = None

    @property
    def num_local_heads(self) -> int:
        return self.kv_head_stop - self.kv_head_start

    @classmethod
    def of_context(
        cls, context: DynamicInferenceContext, peer: dict[str, Any], tp_rank: int, tp_size: int
    ) -> SourceLayout:
        spec = context.spec
        mamba = None
        if context.mamba_slots is not None:
            slots = context.mamba_slots
            mamba = MambaStateDescriptor(
                slots.conv.shape[1],
                tuple(slots.conv.shape[2:]),
                tuple(slots.ssm.shape[2:]),
                dtype_name(slots.conv.dtype),
                dtype_name(slots.ssm.dtype),
            )
        return cls(
            peer,
            spec.attention_layer_numbers,
            spec.mamba_layer_numbers,
            tp_rank * spec.num_kv_heads,
            (tp_rank + 1) * spec.num_kv_heads,
            spec.head_dim,
            spec.block_size,
            context.kv_cache.data.shape[2],
            dtype_name(spec.kv_dtype),
            tp_rank,
            tp_size,
            mamba,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["attention_layers"] = list(self.attention_layers)
        data["mamba_layers"] = list(self.mamba_layers)
        if self.mamba is not None:
            data["mamba"] = dict(
                data["mamba"], conv_shape=list(self.mamba.conv_shape), ssm_shape=list(self.mamba.ssm_shape)
            )
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SourceLayout:
        mamba = data.get("mamba")
        if mamba is not None:
            mamba = MambaStateDescriptor(
                **dict(mamba, conv_shape=tuple(mamba["conv_shape"]), ssm_shape=tuple(mamba["ssm_shape"]))
            )
        return cls(
            **dict(
                data,
                attention_layers=tuple(data["attention_layers"]),
                mamba_layers=tuple(data["mamba_layers"]),
                mamba=mamba,
            )
        )


@dataclass
class HandoffRecord:
    """One prefilled request, ready to be pulled (see module doc).

    ``block_ids`` cover the prompt (the last one may be partial: the pull copies whole
    blocks, whose unused tails the prefill side zeroed); ``block_hashes`` are the chained
    hashes of its full blocks. ``resume_tokens`` = the first sampled token, then MTP drafts;
    ``resume_log_probs`` = the log-prob of the first sampled token; ``resume_top_log_probs`` its
    ``(token id, log-prob)`` top list when the request asked for top log-probs. ``generator_state``
    is the sampler state after that token (non-greedy requests), so sampling continues exactly.
    """

    request_id: str
    prompt_tokens: list[int]
    block_size: int
    block_ids: list[int]
    block_hashes: list[int]
    resume_tokens: list[int]
    resume_log_probs: list[float]
    sources: list[SourceLayout]
    is_hybrid: bool
    mamba_slot: int | None = None
    prompt_log_probs: list[float] | None = None
    generator_state: bytes | None = None
    resume_top_log_probs: list[list[tuple[int, float]]] | None = None

    @property
    def num_drafts(self) -> int:
        return len(self.resume_tokens) - 1

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able values."""
        data = asdict(self)
        data["sources"] = [source.to_dict() for source in self.sources]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HandoffRecord:
        """Rebuild a record; a missing, unknown or malformed field raises :class:`HandoffMetadataError`."""
        if not isinstance(data, dict):
            raise HandoffMetadataError(request_id="?", field="record", problem=f"a {type(data).__name__}, not a map")
        known = set(cls.__dataclass_fields__)
        request_id = str(data.get("request_id", "?"))
        unknown, required = (
            sorted(set(data) - known),
            {
                "request_id",
                "prompt_tokens",
                "block_size",
                "block_ids",
                "block_hashes",
                "resume_tokens",
                "resume_log_probs",
                "sources",
                "is_hybrid",
            },
        )
        missing = sorted(required - set(data))
        if unknown or missing:
            raise HandoffMetadataError(
                request_id=request_id, field="record", problem=f"missing fields {missing}, unknown fields {unknown}"
            )
        try:
            return cls(**dict(data, sources=[SourceLayout.from_dict(s) for s in data["sources"]]))
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise HandoffMetadataError(
                request_id=request_id, field="sources", problem=f"malformed source layout: {exc}"
            ) from exc
