"""Per-request Mamba state slots and the prefix-cache snapshots of Mamba state.

:class:`MambaStateSlots` holds, for each Mamba layer of this stage, a conv state and an SSM
state per slot (``conv [layers, slots, *conv_shape]``, ``ssm [layers, slots, *ssm_shape]``), with
its own free list; a slot is zeroed when handed out (or then overwritten from a snapshot).

:class:`MambaSnapshotStore` keeps the Mamba state at the end of a cached block, keyed by that
block's chained hash, in a fixed number of entries evicted least recently used first. On a
stage without Mamba layers of a hybrid model it keeps only the keys, with the same capacity
and order, so every stage agrees on which prefixes can be resumed from the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron.core.inference.contexts.errors import InferenceContextError, MambaSlotsExhaustedError


@dataclass(frozen=True)
class MambaStateShapes:
    """Per-request, per-layer state shapes (TP-local) and dtypes of one Mamba layer.

    Matches the mixer's ``MambaDims``: ``conv (conv_channels, d_conv - 1)`` and
    ``ssm (nheads, head_dim, d_state)`` kept in fp32.
    """

    conv: tuple[int, ...]
    ssm: tuple[int, ...]
    conv_dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_layer(self) -> int:
        conv = torch.Size(self.conv).numel() * torch.empty((), dtype=self.conv_dtype).element_size()
        ssm = torch.Size(self.ssm).numel() * torch.empty((), dtype=self.ssm_dtype).element_size()
        return conv + ssm


def _state_tensors(num_layers: int, rows: int, shapes: MambaStateShapes, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(num_layers, rows, *shapes.conv, dtype=shapes.conv_dtype, device=device),
        torch.zeros(num_layers, rows, *shapes.ssm, dtype=shapes.ssm_dtype, device=device),
    )


class MambaStateSlots:
    """Conv/SSM state slots of this stage's Mamba layers, handed out from a free list.

    One more row than ``num_slots``, ``scratch_slot``, is never handed out: padding requests
    of a padded step read and write it.
    """

    def __init__(self, num_layers: int, num_slots: int, shapes: MambaStateShapes, device=None):
        if num_layers < 1 or num_slots < 1:
            raise InferenceContextError(
                f"Mamba state slots need >= 1 layer and >= 1 slot, got {num_layers} layers, {num_slots} slots"
            )
        self.shapes = shapes
        self.conv, self.ssm = _state_tensors(num_layers, num_slots + 1, shapes, device)
        self.scratch_slot = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_slots(self) -> int:
        """Slots requests can hold (the scratch slot of padding rows not counted)."""
        return self.scratch_slot

    def allocate(self) -> int:
        """Hand out a slot with zeroed conv and SSM state in every layer (raises
        MambaSlotsExhaustedError when none is free)."""
        if not self._free:
            raise MambaSlotsExhaustedError(f"all {self.scratch_slot} Mamba state slots are in use")
        slot = self._free.pop()
        self.conv[:, slot] = 0
        self.ssm[:, slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise InferenceContextError(f"Mamba slot {slot} freed twice")
        self._free.append(slot)

    def gather(self, layer_index: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``(conv, ssm)`` for ``slots`` of one local layer, in the given order."""
        return self.conv[layer_index, slots], self.ssm[layer_index, slots]

    def scatter(self, layer_index: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Write ``(conv, ssm)`` rows back into ``slots`` of one local layer."""
        self.conv[layer_index, slots] = conv.to(self.conv.dtype)
        self.ssm[layer_index, slots] = ssm.to(self.ssm.dtype)


class MambaSnapshotStore:
    """Mamba states at cached block boundaries, keyed by block hash, LRU in ``num_entries``.

    With ``num_layers == 0`` (a stage of a hybrid model without Mamba layers) only the keys
    are kept, so stages agree on :meth:`__contains__` without storing anything.
    """

    def __init__(self, num_entries: int, num_layers: int, shapes: MambaStateShapes | None, device=None):
        if num_entries < 1:
            raise InferenceContextError(f"a Mamba snapshot store needs >= 1 entry, got {num_entries}")
        self.num_entries = num_entries
        self._rows: OrderedDict[int, int] = OrderedDict()  # block hash -> row, least recent first
        self._free_rows = list(range(num_entries - 1, -1, -1))
        self.conv = self.ssm = None
        if num_layers:
            self.conv, self.ssm = _state_tensors(num_layers, num_entries, shapes, device)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def save(self, block_hash: int, slots: MambaStateSlots | None, slot: int) -> None:
        """Keep the state of ``slot`` (all layers) under ``block_hash``; evicts the LRU entry
        when full. ``slots`` is None on a stage without Mamba layers (keys only)."""
        if block_hash in self._rows:
            self._rows.move_to_end(block_hash)
            row = self._rows[block_hash]
        else:
            if not self._free_rows:
                _, evicted_row = self._rows.popitem(last=False)
                self._free_rows.append(evicted_row)
            row = self._free_rows.pop()
            self._rows[block_hash] = row
        if self.conv is not None:
            self.conv[:, row] = slots.conv[:, slot]
            self.ssm[:, row] = slots.ssm[:, slot]

    def restore(self, block_hash: int, slots: MambaStateSlots | None, slot: int) -> None:
        """Copy the state saved under ``block_hash`` into ``slot`` (and mark it recently used)."""
        row = self._rows[block_hash]
        self._rows.move_to_end(block_hash)
        if self.conv is not None:
            slots.conv[:, slot] = self.conv[:, row]
            slots.ssm[:, slot] = self.ssm[:, row]

    def longest_resumable(self, block_hashes: Sequence[int]) -> int:
        """Largest ``k <= len(block_hashes)`` whose block ``k - 1`` has a snapshot (0 if none)."""
        for k in range(len(block_hashes), 0, -1):
            if block_hashes[k - 1] in self._rows:
                return k
        return 0
