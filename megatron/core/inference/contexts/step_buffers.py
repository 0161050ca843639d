"""Preallocated tensors of a step's metadata (the step path of the dynamic context).

One int64 device buffer holds every field of a :class:`~dynamic_context.StepBatch` at a fixed
offset, sized for the largest step (``max_tokens`` tokens, ``max_requests`` request rows of
``max_blocks`` block-table entries; block tables come last). A step fills the used part of each
field on the host and sends the buffer, up to its last block-table row, to the device in one copy
(from pinned memory, asynchronously, on CUDA; on the CPU the host buffer is the device buffer);
the batch's tensors are views at the fixed offsets. A CUDA graph captured on a bucket's views
therefore reads each later step of that bucket from the same addresses.
"""

from __future__ import annotations

import torch

TOKEN_FIELDS = ("token_ids", "positions", "slot_mapping", "token_requests")
REQUEST_FIELDS = ("query_lengths", "kv_offsets", "kv_lengths", "mamba_slot_ids")


class StepBuffers:
    """The persistent step tensors of one context (see module doc)."""

    def __init__(self, max_tokens: int, max_requests: int, max_blocks: int, device: torch.device):
        self.max_tokens, self.max_requests, self.max_blocks = max_tokens, max_requests, max_blocks
        self.device = device
        self._offsets: dict[str, int] = {}
        offset = 0
        for name in TOKEN_FIELDS:
            self._offsets[name] = offset
            offset += max_tokens
        for name in REQUEST_FIELDS:
            self._offsets[name] = offset
            offset += max_requests
        self._offsets["cu_query_lengths"] = offset
        offset += max_requests + 1
        self._offsets["block_tables"] = offset
        offset += max_requests * max_blocks
        self.size = offset
        self.buffer = torch.zeros(offset, dtype=torch.long, device=device)
        self._on_cpu = device.type == "cpu"

    def host_staging(self) -> torch.Tensor:
        """A host tensor of the buffer's size to fill (on CUDA a fresh pinned one from the caching
        host allocator, which keeps it until its copy is done; on CPU the buffer itself)."""
        if self._on_cpu:
            return self.buffer
        return torch.empty(self.size, dtype=torch.long, pin_memory=True)

    def field(self, buffer: torch.Tensor, name: str, length: int) -> torch.Tensor:
        """The first ``length`` entries of field ``name`` in ``buffer`` (host staging or device)."""
        start = self._offsets[name]
        return buffer[start : start + length]

    def fill(self, staging: torch.Tensor, fields: dict[str, list[int]]) -> None:
        """Write each field's values at the start of that field of the host staging tensor, through
        its numpy view (a list converts there much faster than through a temporary tensor)."""
        host = staging.numpy()
        for name, values in fields.items():
            start = self._offsets[name]
            host[start : start + len(values)] = values

    def block_tables(self, buffer: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """``[rows, width]`` view of the block-table field (rows of ``max_blocks`` entries)."""
        start = self._offsets["block_tables"]
        return buffer[start : start + self.max_requests * self.max_blocks].view(self.max_requests, -1)[:rows, :width]

    def upload(self, staging: torch.Tensor, rows: int) -> None:
        """Copy a filled host staging tensor to the device buffer, up to the end of its first ``rows``
        block-table rows (nothing on CPU)."""
        if staging is not self.buffer:
            end = self._offsets["block_tables"] + rows * self.max_blocks
            self.buffer[:end].copy_(staging[:end], non_blocking=True)
