"""Gradient accumulation fusion: a layer adds its weight gradient straight into DDP's ``main_grad``.

DDP keeps each parameter's gradient in ``param.main_grad`` (a view of a flat buffer, often fp32
for bf16 parameters). Without the fusion a linear layer's backward writes a weight-sized gradient
in the parameter's dtype and DDP's hook adds it to ``main_grad``: one more pass over the weight
and a temporary per weight. With it the weight-gradient GEMM accumulates into ``main_grad``
itself (``C += A @ B``; on CUDA cuBLAS reads and writes the fp32 ``C`` of bf16/fp16 operands),
and the layer returns :func:`main_grad_placeholder` as the weight's gradient.

The placeholder is a zero of the weight's shape that owns no memory (one cached element expanded
with stride 0), so autograd still runs the parameter's gradient accumulator (on the device's
backward thread, like every other node) and DDP's hook still marks the parameter ready exactly
once per backward, after all of its contributions. Contributions that did not take the fused path
(a tied embedding's lookup) arrive summed with it; adding a zero is exact, so the hook adds that
sum as usual and skips only the bare placeholder (:func:`is_main_grad_placeholder`).

The fusion applies where it does not change the arithmetic of the CPU reference path: by default
on CUDA only (CPU results stay bit-identical to the unfused path: a GEMM that accumulates into C
rounds differently from a GEMM then an add). Tests run the same calls on CPU (same-dtype fp32)
inside :func:`fusion_devices`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_devices = {"device_types": frozenset({"cuda"})}
_zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@contextlib.contextmanager
def fusion_devices(*device_types: str):
    """Within the block, fuse on these device types (default: ``"cuda"`` only)."""
    previous = _devices["device_types"]
    _devices["device_types"] = frozenset(device_types)
    try:
        yield
    finally:
        _devices["device_types"] = previous


def fusable_main_grad(weight: torch.Tensor, operand_dtype: torch.dtype) -> bool:
    """Whether a GEMM of ``operand_dtype`` operands can accumulate ``weight``'s gradient into its
    ``main_grad`` in one call: DDP keeps one, on a device the fusion runs on, in the operands'
    dtype, or fp32 for bf16/fp16 operands on CUDA (``addmm`` with an fp32 ``out_dtype``)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or main_grad.device.type not in _devices["device_types"]:
        return False
    if main_grad.dtype == operand_dtype:
        return True
    wide = main_grad.is_cuda and operand_dtype in _LOW_PRECISION and main_grad.dtype == torch.float32
    return wide and _cuda_addmm_accumulates_in_fp32()


@functools.cache
def _cuda_addmm_accumulates_in_fp32() -> bool:
    """Whether this PyTorch's CUDA ``addmm`` with an fp32 ``out_dtype`` takes an fp32 ``self`` (the
    accumulator) of bf16 operands (PyTorch >= 2.10; older ones want ``self`` in the operands'
    dtype). Asked once per process."""
    acc = torch.ones(1, 1, device="cuda")
    operand = torch.ones(1, 1, device="cuda", dtype=torch.bfloat16)
    try:
        torch.addmm(acc, operand, operand, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return acc.item() == 2.0


def add_product_to_main_grad(main_grad: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    """``main_grad += mat1 @ mat2`` by the GEMM itself (``mat1``/``mat2``: 2-D, one dtype, for which
    :func:`fusable_main_grad` holds)."""
    if main_grad.dtype == mat1.dtype:
        main_grad.addmm_(mat1, mat2)
    else:  # cuBLAS: bf16/fp16 operands, fp32 accumulation, C read and written in fp32
        torch.addmm(main_grad, mat1, mat2, out_dtype=main_grad.dtype, out=main_grad)


def main_grad_placeholder(weight: torch.Tensor) -> torch.Tensor:
    """The gradient a layer returns for ``weight`` once it has added the real one to
    ``weight.main_grad``: zeros of its shape, dtype and device, backed by one cached element."""
    key = (weight.device, weight.dtype)
    zero = _zeros.get(key)
    if zero is None:
        zero = _zeros[key] = torch.zeros((), device=weight.device, dtype=weight.dtype)
    return zero.expand(weight.shape)


def is_main_grad_placeholder(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a bare :func:`main_grad_placeholder` (nothing for DDP's hook to add)."""
    zero = _zeros.get((grad.device, grad.dtype))
    return zero is not None and grad.untyped_storage().data_ptr() == zero.untyped_storage().data_ptr()
