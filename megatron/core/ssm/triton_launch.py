"""Launch helpers shared by the Mamba mixer's Triton kernels (:mod:`conv1d_triton`,
:mod:`gated_norm_triton`): operand checks of the ``[d0, d1, channels]`` views they take (any
strides on the two token dimensions, channel stride 1), and the split of a backward's rows
over programs that each walk several tiles, so that fewer weight-gradient partials are summed."""

from __future__ import annotations

import torch
import triton


def check_channel_view(kernel: str, name: str, t: torch.Tensor, shape: torch.Size) -> None:
    """Raise ValueError unless ``t`` has ``shape`` and channel stride 1."""
    if t.shape != shape or t.stride(-1) != 1:
        raise ValueError(f"{kernel}: {name} must be {tuple(shape)} with channel stride 1, got {tuple(t.shape)}")


def with_channel_stride_1(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its channel stride is 1, else a contiguous copy (an incoming gradient
    may have any layout)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def backward_programs(rows: int, block: int, rows_per_program: int) -> tuple[int, int]:
    """``(programs, tiles_per_program)`` for ``rows`` rows in tiles of ``block``, each program
    walking about ``rows_per_program`` rows; no program is left without a row."""
    tiles = triton.cdiv(triton.cdiv(rows, triton.cdiv(rows, rows_per_program)), block)
    return triton.cdiv(rows, tiles * block), tiles
