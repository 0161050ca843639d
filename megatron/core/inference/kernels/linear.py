"""The batch-invariant linear: ``x @ W.T (+ bias)`` whose rows do not depend on the row count.

Backends (:func:`~megatron.core.inference.kernels.mode.kernel_backend`): the Triton GEMM of
:mod:`matmul_triton` (one tile shape per weight shape, no split-K), or on CPU the torch path
below: BLAS computes a fixed-shape call the same way whatever the values in it, so the rows are
multiplied in tiles of :data:`ROW_TILE` (the last one zero-padded), one call per tile, and a row's
bits depend on nothing but the row. ``torch.nn.functional.linear`` stays the oracle.

One call per tile is slow for a long step (a prefill chunk of 512 rows makes 32 small GEMMs), and
BLAS often computes a GEMM of a multiple of the tile rows exactly as it computes the tiles
(blocking over rows and columns, the same reduction over ``K``). Whether it does is a property of
the shapes, the dtype and the thread count, not of the values, so it is probed once per such key
(:func:`_whole_call_matches_tiles`, random operands of that shape) and the step then runs as one
call only where the probe found the bits of the tiles: the numbers are those of the tiles either way.
"""

from __future__ import annotations

import torch

from megatron.core.inference.kernels.mode import kernel_backend

ROW_TILE = 16

# (padded rows, weight shape and strides, dtypes, device, threads) -> one call gives the tiles' bits.
_WHOLE_CALL_MATCHES: dict[tuple, bool] = {}


def _tiled_matmul(rows: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for start in range(0, rows.shape[0], ROW_TILE):
        torch.matmul(rows[start : start + ROW_TILE], weight_t, out=out[start : start + ROW_TILE])
    return out


def _whole_call_matches_tiles(rows: torch.Tensor, weight_t: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether one GEMM over ``rows`` (a multiple of :data:`ROW_TILE`) gives bitwise the tiled
    GEMMs' result, probed once per key with random operands of the same shapes, strides and dtypes."""
    key = (
        rows.shape,
        rows.stride(),
        rows.dtype,
        weight_t.shape,
        weight_t.stride(),
        weight_t.dtype,
        out_dtype,
        rows.device,
        torch.get_num_threads(),
    )
    matches = _WHOLE_CALL_MATCHES.get(key)
    if matches is None:
        generator = torch.Generator().manual_seed(0)
        probe, probe_w = (
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(
                torch.randn(t.shape, generator=generator)
            )
            for t in (rows, weight_t)
        )
        shape = (rows.shape[0], weight_t.shape[1])
        tiles = _tiled_matmul(probe, probe_w, torch.empty(shape, dtype=out_dtype, device=rows.device))
        whole = torch.matmul(probe, probe_w, out=torch.empty(shape, dtype=out_dtype, device=rows.device))
        matches = _WHOLE_CALL_MATCHES[key] = torch.equal(tiles, whole)
    return matches


def torch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: fixed-shape GEMMs of :data:`ROW_TILE` rows, or one GEMM with their bits
    (see module doc)."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    num_rows = rows.shape[0]
    padded = -(-num_rows // ROW_TILE) * ROW_TILE
    if padded != num_rows:
        rows = torch.cat([rows, rows.new_zeros(padded - num_rows, k)])
    out_dtype = torch.result_type(x, weight)
    weight_t = weight.t()
    if padded == ROW_TILE or _whole_call_matches_tiles(rows, weight_t, out_dtype):
        out = torch.matmul(rows, weight_t)  # one call: a single tile, or one the probe found gives the tiles' bits
    else:
        out = _tiled_matmul(rows, weight_t, torch.empty(padded, weight.shape[0], dtype=out_dtype, device=x.device))
    if padded != num_rows:
        out = out[:num_rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias)``, each row independent of how many rows ``x`` has
    (see module doc); forward only. ``backend``: ``"auto"``, ``"torch"`` or ``"triton"``."""
    if kernel_backend(x.device, backend) == "triton":
        from megatron.core.inference.kernels.matmul_triton import triton_linear

        return triton_linear(x, weight, bias)
    return torch_invariant_linear(x, weight, bias)
