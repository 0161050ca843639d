"""Dropout on activations that are replicated or sequence-sharded across TP ranks."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import get_rng_tracker


def sharded_rng_context(sharded_over_tp: bool):
    """The tracker's model-parallel RNG stream when the activation differs per TP rank (sequence
    or head sharded: each rank must draw its own mask), else the default RNG (replicated)."""
    return get_rng_tracker().fork() if sharded_over_tp else contextlib.nullcontext()


def dropout(x: torch.Tensor, p: float, training: bool, sharded_over_tp: bool = False) -> torch.Tensor:
    """``F.dropout`` drawing its mask from the RNG stream that matches how ``x`` is sharded."""
    if not training or p == 0.0:
        return x
    with sharded_rng_context(sharded_over_tp):
        return F.dropout(x, p=p, training=True)


def dropout_seed(device: torch.device, sharded_over_tp: bool = False) -> torch.Tensor:
    """A one-element int64 seed for in-kernel (Philox) dropout, drawn on ``device`` from the RNG
    stream :func:`dropout` would use; a device tensor, so a CUDA graph can replay the draw."""
    with sharded_rng_context(sharded_over_tp):
        return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)
