"""A tensor that a save reads only when it writes it.

A :class:`LazyTensor` can stand wherever a save takes a tensor's data (a ShardedTensor's or a
factory's ``data``): its shape and dtype are known up front, which is all that describing,
validating and planning a save need, and its rows are loaded by ``load_rows(start, stop)``
only when the writer reaches the piece, then dropped once written. A converter can so write a
checkpoint much larger than its memory from a source read piece by piece (e.g. safetensors).
Slicing rows gives another lazy tensor; nothing else is supported.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron.core.dist_checkpointing.errors import CheckpointingError


class LazyTensor:
    """Rows ``[start, start + shape[0])`` of a tensor read by ``load_rows(start, stop)``."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        load_rows: Callable[[int, int], torch.Tensor],
        start: int = 0,
        name: str = "lazy tensor",
    ):
        if not shape:
            raise CheckpointingError(f"{name}: a lazy tensor needs at least one dimension (rows), got shape ()")
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.name = name
        self._load_rows = load_rows
        self._start = start

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, index) -> LazyTensor:
        """Rows ``index`` (a slice with step 1), still lazy."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise CheckpointingError(f"{self.name}: a lazy tensor supports only row slices, got index {index!r}")
        start, stop, _ = index.indices(self.shape[0])
        rows = max(0, stop - start)
        return LazyTensor((rows,) + tuple(self.shape[1:]), self.dtype, self._load_rows, self._start + start, self.name)

    def reshape(self, *shape) -> LazyTensor:
        """Itself: a save reshapes data to its local shape, which is this shape (no prepended axes)."""
        wanted = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else tuple(shape)
        if wanted != tuple(self.shape):
            raise CheckpointingError(f"{self.name}: a lazy tensor of shape {tuple(self.shape)} cannot become {wanted}")
        return self

    def materialize(self) -> torch.Tensor:
        """Read the rows; CheckpointingError when what was read has another shape or dtype."""
        tensor = self._load_rows(self._start, self._start + self.shape[0])
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            raise CheckpointingError(
                f"{self.name}: rows [{self._start}, {self._start + self.shape[0]}) were read as "
                f"{tuple(tensor.shape)} {tensor.dtype}, declared {tuple(self.shape)} {self.dtype}"
            )
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self.name}, rows {self._start}+{tuple(self.shape)}, {self.dtype})"
