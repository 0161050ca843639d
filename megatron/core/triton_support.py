"""Whether Triton kernels can run here: one answer for every backend switch (the fused ops,
the inference kernels, paged attention).

Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported), which is how the unit tests run them.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether ``import triton`` succeeds (asked once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on ``device``: CUDA, or any under the interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
