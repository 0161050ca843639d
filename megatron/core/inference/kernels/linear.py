"""The batch-invariant linear: ``x @ W.T (+ bias)`` whose rows do not depend on the row count.

Backends (:func:`~megatron.core.inference.kernels.mode.kernel_backend`): the Triton GEMM of
:mod:`matmul_triton` (one tile shape per weight shape, no split-K), or on CPU the torch path
below: BLAS computes a fixed-shape call the same way whatever the values in it, so the rows are
multiplied in tiles of :data:`ROW_TILE` (the last one zero-padded), one call per tile, and a row's
bits depend on nothing but the row. ``torch.nn.functional.linear`` stays the oracle.
"""

from __future__ import annotations

import torch

from megatron.core.inference.kernels.mode import kernel_backend

ROW_TILE = 16


def torch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: fixed-shape GEMMs of :data:`ROW_TILE` rows (see module doc)."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    num_rows = rows.shape[0]
    padded = -(-num_rows // ROW_TILE) * ROW_TILE
    if padded != num_rows:
        rows = torch.cat([rows, rows.new_zeros(padded - num_rows, k)])
    out = torch.empty(padded, weight.shape[0], dtype=torch.result_type(x, weight), device=x.device)
    weight_t = weight.t()
    for start in range(0, padded, ROW_TILE):
        torch.matmul(rows[start : start + ROW_TILE], weight_t, out=out[start : start + ROW_TILE])
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
