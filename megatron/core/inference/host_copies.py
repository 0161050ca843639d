"""Copies between the host and the device that never make the host wait for queued device work.

A step's inputs go to the device through pinned memory with asynchronous copies
(:func:`to_device`: a copy from pageable memory would first wait for every queued kernel), and its
results come back the same way (:class:`DeviceToHost`: start the copy, read it later).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (CPU) on ``device``: itself on the CPU; on CUDA through pinned memory, copied
    asynchronously (the caching host allocator keeps the pinned block until the copy is done)."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class DeviceToHost:
    """Device tensors copied to the host asynchronously; :meth:`wait` returns the host copies
    (the same tensors on the CPU)."""

    def __init__(self, *tensors: torch.Tensor):
        self._event = None
        if tensors and tensors[0].device.type == "cuda":
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
            for host, tensor in zip(self._host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def wait(self) -> tuple[torch.Tensor, ...]:
        """The host copies, once the device wrote them."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
