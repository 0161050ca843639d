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

The tiles rest on BLAS rounding a row the same at every position of a tile. Some kernels do not
for some weight shapes (MKL on AVX2 rounds odd rows differently with a 6-long reduction), which a
second probe per weight shape finds (:func:`_tile_rows_are_position_free`); such a shape is
multiplied one row per call.
"""

from __future__ import annotations

import torch

from megatron.core.inference.kernels.mode import kernel_backend

ROW_TILE = 16

# (padded rows, weight shape and strides, dtypes, device, threads) -> one call gives the tiles' bits.
_WHOLE_CALL_MATCHES: dict[tuple, bool] = {}
# (weight shape and strides, dtypes, device, threads) -> a tile's rows get the same bits at any position.
_POSITION_FREE: dict[tuple, bool] = {}


def _tiled_matmul(rows: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for start in range(0, rows.shape[0], ROW_TILE):
        torch.matmul(rows[start : start + ROW_TILE], weight_t, out=out[start : start + ROW_TILE])
    return out


def _random_like(t: torch.Tensor, shape=None) -> torch.Tensor:
    """Random values with ``t``'s shape (or ``shape``), strides (contiguous for a new shape), dtype and device."""
    generator = torch.Generator().manual_seed(0)
    if shape is None:
        empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    else:
        empty = torch.empty(shape, dtype=t.dtype, device=t.device)
    return empty.copy_(torch.randn(empty.shape, generator=generator))


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
        probe, probe_w = _random_like(rows), _random_like(weight_t)
        shape = (rows.shape[0], weight_t.shape[1])
        tiles = _tiled_matmul(probe, probe_w, torch.empty(shape, dtype=out_dtype, device=rows.device))
        whole = torch.matmul(probe, probe_w, out=torch.empty(shape, dtype=out_dtype, device=rows.device))
        matches = _WHOLE_CALL_MATCHES[key] = torch.equal(tiles, whole)
    return matches


def _tile_rows_are_position_free(weight_t: torch.Tensor, rows_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether a :data:`ROW_TILE`-row GEMM by ``weight_t`` gives a row the same bits at every
    position of the tile (probed once per key, by moving random rows to every other position)."""
    key = (
        weight_t.shape,
        weight_t.stride(),
        weight_t.dtype,
        rows_dtype,
        out_dtype,
        weight_t.device,
        torch.get_num_threads(),
    )
    free = _POSITION_FREE.get(key)
    if free is None:
        probe_w = _random_like(weight_t)
        rows = _random_like(probe_w, (ROW_TILE, weight_t.shape[0])).to(rows_dtype)
        want = torch.matmul(rows, probe_w)
        free = all(
            torch.equal(torch.matmul(rows.roll(shift, 0), probe_w).roll(-shift, 0), want)
            for shift in range(1, ROW_TILE)
        )
        _POSITION_FREE[key] = free
    return free


def torch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: fixed-shape GEMMs of :data:`ROW_TILE` rows, or one GEMM with their bits
    (see module doc)."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    num_rows = rows.shape[0]
    out_dtype = torch.result_type(x, weight)
    weight_t = weight.t()
    if not _tile_rows_are_position_free(weight_t, rows.dtype, out_dtype):
        out = torch.cat([torch.matmul(rows[i : i + 1], weight_t) for i in range(num_rows)])
        out = out if bias is None else out + bias
        return out.reshape(*lead, weight.shape[0])
    padded = -(-num_rows // ROW_TILE) * ROW_TILE
    if padded != num_rows:
        rows = torch.cat([rows, rows.new_zeros(padded - num_rows, k)])
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
