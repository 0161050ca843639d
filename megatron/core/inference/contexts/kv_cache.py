"""The paged KV buffer of one pipeline stage.

One preallocated tensor ``[2 (K, V), layers, blocks, block_size, kv_heads_per_tp, head_dim]``
holding every usable block plus the dummy block (the last one). Storage is not zeroed at
creation (as on a GPU, stale bytes may be anything); the block pool zeroes each page when it
becomes private, and the dummy block is zeroed here once since padding reads may touch it.
A token's *slot* is ``block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.core.inference.host_copies import to_device


class PagedKVCache:
    """K/V pages of this stage's attention layers (``num_layers`` may be 0: nothing stored)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks_with_dummy: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        self.block_size = block_size
        self.data = torch.empty(
            2, num_layers, num_blocks_with_dummy, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.data[:, :, -1] = 0
        # Per layer, the views every step's store and attention take (made once, not per layer and step).
        row = num_kv_heads * head_dim
        flat = self.data.view(-1, row)
        self._slot_rows = [flat[i * (self.data.stride(1) // row) :] for i in range(num_layers)]
        planes = [self.data[:, i].flatten(1, 2) for i in range(num_layers)]  # [2, slots, heads, dim]
        self._planes = [(both, *both.unbind()) for both in planes]  # (both, keys, values)

    @property
    def num_layers(self) -> int:
        return self.data.shape[1]

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the K and V planes of ``block_ids`` in every layer of this stage (queued on the
        device: the ids go up from pinned memory, so the host never waits for the step in flight)."""
        index = to_device(torch.tensor(list(block_ids), dtype=torch.long), self.data.device)
        self.data.index_fill_(2, index, 0)

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(key, value)`` of one local layer, each ``[blocks, block_size, heads, dim]``."""
        return self.data[0, layer_index], self.data[1, layer_index]

    @property
    def value_slot_offset(self) -> int:
        """Slots from a layer's key plane to its value plane in :meth:`slots_from`."""
        return self.data.stride(0) // self.data[0, 0, 0, 0].numel()

    def slots_from(self, layer_index: int) -> torch.Tensor:
        """The cache as slot rows ``[*, heads * dim]`` from one local layer's key plane on: row
        ``slot`` is that layer's keys of the slot, row ``slot + value_slot_offset`` its values (one
        gather reads both)."""
        return self._slot_rows[layer_index]

    def store(self, layer_index: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[tokens, heads, dim]`` into the slots ``slot_mapping [tokens]``:
        one copy when they are two planes of one tensor (as the fused RoPE split makes them)."""
        both, keys, values = self._planes[layer_index]
        pair = planes_of_one_tensor(key, value)
        if pair is not None:
            both.index_copy_(1, slot_mapping, pair.to(self.data.dtype))
            return
        keys.index_copy_(0, slot_mapping, key.to(self.data.dtype))
        values.index_copy_(0, slot_mapping, value.to(self.data.dtype))


def planes_of_one_tensor(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """A ``[2, *first.shape]`` view whose planes are ``first`` and ``second``, where both lie in one
    storage with the same shape, strides and dtype, ``second`` further on; else None."""
    if (first.shape, first.stride(), first.dtype, first.device) != (
        second.shape,
        second.stride(),
        second.dtype,
        second.device,
    ):
        return None
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None
    gap = second.storage_offset() - first.storage_offset()
    return first.as_strided((2, *first.shape), (gap, *first.stride())) if gap > 0 else None
