"""Which bytes a decode rank pulls from which prefill rank.

Caches are contiguous tensors: KV ``[2 (K, V), layers, blocks, block_size, heads, head_dim]``,
Mamba ``conv [layers, slots, ...]`` and ``ssm [layers, slots, ...]``. A decode rank needs, for
each of its attention layers (global numbers), its KV head range: every prefill rank holding
that layer with an overlapping head range supplies the overlap. When the two ranks hold the
same heads (equal TP), a block is one contiguous run; otherwise each token of a block holds
the overlap as its own run (different TP sizes). Mamba state moves between ranks of the same
TP rank and size (its channels are not head-sliced here). Block runs whose ids ascend on both
sides move as one segment per layer plane; adjacent segments are merged. A long import may be
pulled in layer groups (:func:`layer_groups`): each group's runs are planned (and posted) on their
own, so the first group can land while later ones are still in flight.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core.inference.handoff.failures import HandoffMetadataError
from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout, dtype_from_name

KV_REGION, CONV_REGION, SSM_REGION = "kv", "conv", "ssm"


@dataclass(frozen=True)
class Segment:
    """One contiguous run: ``nbytes`` from ``src_region + src_offset`` of source ``source``
    into ``dst_region + dst_offset`` of the local buffers."""

    source: int
    src_region: str
    src_offset: int
    dst_region: str
    dst_offset: int
    nbytes: int


def _kv_offset(layout: SourceLayout, plane: int, layer_index: int, block: int, token: int, head: int) -> int:
    num_layers = len(layout.attention_layers)
    index = (
        ((plane * num_layers + layer_index) * layout.num_blocks_with_dummy + block) * layout.block_size + token
    ) * layout.num_local_heads + head
    return index * layout.head_dim * _itemsize(layout.kv_dtype)


@functools.cache
def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def _check_compatible(record: HandoffRecord, local: SourceLayout, source: SourceLayout) -> None:
    for name in ("head_dim", "block_size", "kv_dtype"):
        if getattr(source, name) != getattr(local, name):
            raise HandoffMetadataError(
                request_id=record.request_id,
                field=name,
                problem=f"prefill has {getattr(source, name)!r}, this engine "
                f"{getattr(local, name)!r}; both sides must match",
            )


def _merge(segments: list[Segment]) -> list[Segment]:
    merged: list[Segment] = []
    for seg in segments:
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.source, last.src_region, last.dst_region) == (seg.source, seg.src_region, seg.dst_region)
            and last.src_offset + last.nbytes == seg.src_offset
            and last.dst_offset + last.nbytes == seg.dst_offset
        ):
            merged[-1] = Segment(
                last.source,
                last.src_region,
                last.src_offset,
                last.dst_region,
                last.dst_offset,
                last.nbytes + seg.nbytes,
            )
        else:
            merged.append(seg)
    return merged


def _kv_supply(record: HandoffRecord, local: SourceLayout) -> list[list[tuple[int, SourceLayout, int, int]]]:
    """For each local attention layer (in order), who supplies its KV heads: ``(source index,
    source, head start, head stop)``. Raises :class:`HandoffMetadataError` when a source holding
    the layer does not match this engine's cache or the heads are not all covered."""
    supply = []
    for layer in local.attention_layers:
        overlaps, covered = [], 0
        for source_index, source in enumerate(record.sources):
            if layer not in source.attention_layers:
                continue
            _check_compatible(record, local, source)
            start, stop = max(local.kv_head_start, source.kv_head_start), min(local.kv_head_stop, source.kv_head_stop)
            if start < stop:
                overlaps.append((source_index, source, start, stop))
                covered += stop - start
        if covered != local.num_local_heads:
            raise HandoffMetadataError(
                request_id=record.request_id,
                field="sources",
                problem=f"layer {layer} heads [{local.kv_head_start}, {local.kv_head_stop}) are not all held by the "
                f"prefill ranks (covered {covered} of {local.num_local_heads})",
            )
        supply.append(overlaps)
    return supply


def _mamba_supply(record: HandoffRecord, local: SourceLayout) -> list[tuple[int, SourceLayout]]:
    """For each local Mamba layer (in order), the source holding its state: ``(source index,
    source)``. Raises :class:`HandoffMetadataError` when none matches this engine's layout."""
    supply = []
    for layer in local.mamba_layers:
        matches = [
            (i, s)
            for i, s in enumerate(record.sources)
            if layer in s.mamba_layers and (s.tp_rank, s.tp_size) == (local.tp_rank, local.tp_size)
        ]
        if not matches:
            raise HandoffMetadataError(
                request_id=record.request_id,
                field="sources",
                problem=f"no prefill rank holds Mamba layer {layer} at TP rank {local.tp_rank} of {local.tp_size} "
                f"(Mamba state moves only between equal TP layouts)",
            )
        source = matches[0][1]
        if source.mamba is None or (source.mamba.conv_shape, source.mamba.ssm_shape) != (
            local.mamba.conv_shape,
            local.mamba.ssm_shape,
        ):
            shapes = "none" if source.mamba is None else f"{source.mamba.conv_shape}, {source.mamba.ssm_shape}"
            raise HandoffMetadataError(
                request_id=record.request_id,
                field="mamba",
                problem=f"prefill state shapes {shapes} differ from {local.mamba.conv_shape}, {local.mamba.ssm_shape}",
            )
        supply.append(matches[0])
    return supply


def check_plan(record: HandoffRecord, local: SourceLayout) -> None:
    """Raise the :class:`HandoffMetadataError` that planning ``record``'s pulls into ``local``
    would raise (run at submission, so a record that cannot be planned is never queued); also
    checks the source block ids and Mamba slot against the sources' buffers."""

    def out_of_range(name, problem):
        return HandoffMetadataError(request_id=record.request_id, field=name, problem=problem)

    for overlaps in _kv_supply(record, local):
        for _, source, _, _ in overlaps:
            usable = source.num_blocks_with_dummy - 1
            if any(not 0 <= block < usable for block in record.block_ids):
                raise out_of_range("block_ids", f"ids must lie in [0, {usable}) of the prefill rank's pool")
    for _, source in _mamba_supply(record, local):
        if record.mamba_slot is None or not 0 <= record.mamba_slot < source.mamba.num_slots:
            raise out_of_range(
                "mamba_slot", f"{record.mamba_slot!r} is not a slot of the prefill rank's {source.mamba.num_slots}"
            )


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """``(source block, destination block, length)`` of the maximal runs of ``src_blocks[i] ->
    dst_blocks[i]`` along which both ids ascend by one: each run of a layer's K (V) plane is
    one contiguous range on both sides."""
    src, dst = np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    if not len(src):
        return []
    starts = np.concatenate(([0], np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist(), strict=True))


def layer_groups(local: SourceLayout, layers_per_group: int | None) -> list[tuple[int, ...]]:
    """This rank's layers (attention and Mamba, global numbers) in model order, cut into groups of
    ``layers_per_group`` (one group of all when None)."""
    layers = sorted((*local.attention_layers, *local.mamba_layers))
    if layers_per_group is None:
        return [tuple(layers)]
    if layers_per_group < 1:
        raise ValueError(f"layers_per_group must be >= 1, got {layers_per_group}")
    return [tuple(layers[i : i + layers_per_group]) for i in range(0, len(layers), layers_per_group)]


def plan_kv(
    record: HandoffRecord,
    local: SourceLayout,
    src_blocks: list[int],
    dst_blocks: list[int],
    layers: Collection[int] | None = None,
) -> list[Segment]:
    """KV runs for ``src_blocks[i] -> dst_blocks[i]`` of every local attention layer (of those in
    ``layers``, global numbers, when given), layer by layer. With equal heads on both sides, one
    segment per (layer, K/V, block run); otherwise one per (layer, K/V, block, token)."""
    segments = []
    width = local.head_dim * _itemsize(local.kv_dtype)
    runs = block_runs(src_blocks, dst_blocks)
    for layer_index, overlaps in enumerate(_kv_supply(record, local)):
        if layers is not None and local.attention_layers[layer_index] not in layers:
            continue
        for source_index, source, start, stop in overlaps:
            src_layer = source.attention_layers.index(local.attention_layers[layer_index])
            same_heads = (
                (start, stop)
                == (source.kv_head_start, source.kv_head_stop)
                == (local.kv_head_start, local.kv_head_stop)
            )
            if same_heads:
                pieces = [
                    (src, dst, 0, length * local.block_size * local.num_local_heads * width)
                    for src, dst, length in runs
                ]
            else:
                pieces = [
                    (src + i, dst + i, token, (stop - start) * width)
                    for src, dst, length in runs
                    for i in range(length)
                    for token in range(local.block_size)
                ]
            for plane in (0, 1):
                for src_block, dst_block, token, nbytes in pieces:
                    segments.append(
                        Segment(
                            source_index,
                            KV_REGION,
                            _kv_offset(source, plane, src_layer, src_block, token, start - source.kv_head_start),
                            KV_REGION,
                            _kv_offset(local, plane, layer_index, dst_block, token, start - local.kv_head_start),
                            nbytes,
                        )
                    )
    return _merge(segments)


def plan_mamba(
    record: HandoffRecord, local: SourceLayout, dst_slot: int, layers: Collection[int] | None = None
) -> list[Segment]:
    """Conv and SSM state runs of the record's slot into ``dst_slot`` for every local Mamba layer
    (of those in ``layers`` when given)."""
    segments = []
    for layer_index, (source_index, source) in enumerate(_mamba_supply(record, local)):
        if layers is not None and local.mamba_layers[layer_index] not in layers:
            continue
        src_layer = source.mamba_layers.index(local.mamba_layers[layer_index])
        for region, which in ((CONV_REGION, "conv"), (SSM_REGION, "ssm")):
            row = local.mamba.row_bytes(which)
            segments.append(
                Segment(
                    source_index,
                    region,
                    (src_layer * source.mamba.num_slots + record.mamba_slot) * row,
                    region,
                    (layer_index * local.mamba.num_slots + dst_slot) * row,
                    row,
                )
            )
    return segments
