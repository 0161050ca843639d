"""Large sequential file I/O that hashes the bytes as they pass and overlaps the two.

One background thread issues the system calls (``os.write`` / ``os.preadv``, which release
the GIL) in submission order while the caller hashes the same bytes (``xxhash`` releases the
GIL too), chunk by chunk. CPU tensors are written from and read into their own memory (no
intermediate copy); CUDA tensors pass through a small ring of pinned host buffers, their
device-host copies running on a side stream, overlapped with the file I/O of the previous
chunk.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

CHUNK_BYTES = 4 << 20
RING_SLOTS = 3


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview of its memory."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]


def _pread_into(fd: int, data: memoryview, offset: int) -> int:
    done = 0
    while done < len(data):
        n = os.preadv(fd, [data[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class _PinnedRing:
    """``RING_SLOTS`` pinned host buffers of CHUNK_BYTES and a copy stream for one CUDA device;
    each slot remembers the I/O future and the copy event that still use it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(RING_SLOTS)]
        self.futures: list[Future | None] = [None] * RING_SLOTS
        self.events = [torch.cuda.Event() for _ in range(RING_SLOTS)]
        self._next = 0

    def acquire(self) -> int:
        """The next slot, once the I/O and the copy that last used it are done."""
        slot = self._next
        self._next = (slot + 1) % RING_SLOTS
        if self.futures[slot] is not None:
            self.futures[slot].result()
            self.futures[slot] = None
        self.events[slot].synchronize()
        return slot


class StreamIO:
    """The I/O thread of one file's writes or reads, and the pinned rings of CUDA transfers.

    Use as a context manager; every submitted call has finished (or failed) when it exits.
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-io")
        self._rings: dict[torch.device, _PinnedRing] = {}

    def __enter__(self) -> StreamIO:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def ring(self, device: torch.device) -> _PinnedRing:
        if device not in self._rings:
            self._rings[device] = _PinnedRing(device)
        return self._rings[device]


class SequentialWriter:
    """Appends to one new file through a :class:`StreamIO`. Small writes are coalesced; tensor
    bytes go out in CHUNK_BYTES writes. ``position`` counts every byte submitted."""

    def __init__(self, path: str, io: StreamIO):
        self.path = path
        self.position = 0
        self._io = io
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pending = bytearray()
        self._futures: deque[Future] = deque()

    def _submit(self, data: memoryview) -> None:
        self._futures.append(self._io.submit(_write_all, self._fd, data))
        while self._futures and self._futures[0].done():
            self._futures.popleft().result()  # fail fast on a write error

    def _flush_pending(self) -> None:
        if self._pending:
            self._submit(memoryview(bytes(self._pending)))
            self._pending.clear()

    def write_small(self, data, hasher) -> None:
        """Hash and buffer ``data`` (copied: the caller's buffer may be reused at once)."""
        data = memoryview(data).cast("B")
        hasher.update(data)
        self._pending += data
        self.position += len(data)

    def write_tensor(self, tensor: torch.Tensor, hasher) -> None:
        """Hash and write the raw bytes of the contiguous ``tensor`` (CPU, or CUDA through
        pinned buffers). The tensor must not change until :meth:`close` returns."""
        self._flush_pending()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":
            self._write_cuda(tensor, nbytes, hasher)
        else:
            data = tensor_bytes(tensor)
            for start in range(0, nbytes, CHUNK_BYTES):
                chunk = data[start : start + CHUNK_BYTES]
                self._submit(chunk)
                hasher.update(chunk)
        self.position += nbytes

    def _write_cuda(self, tensor: torch.Tensor, nbytes: int, hasher) -> None:
        ring = self._io.ring(tensor.device)
        flat = tensor.reshape(-1).view(torch.uint8)
        ring.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        copied: deque[tuple[int, int]] = deque()

        def write_oldest():
            slot, n = copied.popleft()
            ring.events[slot].synchronize()
            data = tensor_bytes(ring.buffers[slot])[:n]
            hasher.update(data)
            ring.futures[slot] = self._io.submit(_write_all, self._fd, data)
            self._futures.append(ring.futures[slot])

        for start in range(0, nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, nbytes - start)
            slot = ring.acquire()
            with torch.cuda.stream(ring.stream):
                ring.buffers[slot][:n].copy_(flat[start : start + n], non_blocking=True)
                ring.events[slot].record(ring.stream)
            copied.append((slot, n))
            if len(copied) > 1:
                write_oldest()
        while copied:
            write_oldest()

    def drain(self) -> None:
        """Wait for every write submitted so far (the tensors they read may then be freed)."""
        self._flush_pending()
        while self._futures:
            self._futures.popleft().result()

    def close(self, fsync: bool = True) -> None:
        """Wait for every write, fsync (on the I/O thread) and close; raises the first write error."""
        try:
            self._flush_pending()
            if fsync:
                self._futures.append(self._io.submit(os.fsync, self._fd))
            while self._futures:
                self._futures.popleft().result()
        finally:
            os.close(self._fd)


def read_into(io: StreamIO, fd: int, offset: int, dest: torch.Tensor, hasher) -> int:
    """Read ``dest.nbytes`` bytes at ``offset`` straight into the contiguous tensor ``dest``
    (CPU, or CUDA through pinned buffers), hashing them as they arrive; returns the bytes read
    (fewer at the end of the file)."""
    nbytes = dest.numel() * dest.element_size()
    if dest.device.type == "cuda":
        return _read_into_cuda(io, fd, offset, dest, nbytes, hasher)
    data = tensor_bytes(dest)
    chunks = [(start, data[start : start + CHUNK_BYTES]) for start in range(0, nbytes, CHUNK_BYTES)]
    futures = [io.submit(_pread_into, fd, chunk, offset + start) for start, chunk in chunks]
    done = 0
    for (_, chunk), future in zip(chunks, futures, strict=True):
        n = future.result()
        hasher.update(chunk[:n])
        done += n
        if n < len(chunk):
            break
    for future in futures:
        future.result()
    return done


def _read_into_cuda(io: StreamIO, fd: int, offset: int, dest: torch.Tensor, nbytes: int, hasher) -> int:
    ring = io.ring(dest.device)
    flat = dest.reshape(-1).view(torch.uint8)
    ring.stream.wait_stream(torch.cuda.current_stream(dest.device))
    reads: deque[tuple[int, int, int]] = deque()
    done = 0

    def copy_oldest() -> int:
        slot, start, n_wanted = reads.popleft()
        n = ring.futures[slot].result()
        ring.futures[slot] = None
        data = ring.buffers[slot][:n]
        hasher.update(tensor_bytes(data))
        with torch.cuda.stream(ring.stream):
            flat[start : start + n].copy_(data, non_blocking=True)
            ring.events[slot].record(ring.stream)
        return n

    for start in range(0, nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, nbytes - start)
        slot = ring.acquire()
        ring.futures[slot] = io.submit(_pread_into, fd, tensor_bytes(ring.buffers[slot])[:n], offset + start)
        reads.append((slot, start, n))
        if len(reads) > 1:
            done += copy_oldest()
    while reads:
        done += copy_oldest()
    torch.cuda.current_stream(dest.device).wait_stream(ring.stream)
    return done


def read_small(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer at the end of the file)."""
    return os.pread(fd, length, offset)


def hash_range(io: StreamIO, fd: int, offset: int, length: int, hasher) -> int:
    """Hash ``length`` bytes of the file at ``offset`` through two alternating buffers (one
    being read while the other is hashed); returns the bytes read."""
    buffers = [memoryview(bytearray(min(CHUNK_BYTES, length))) for _ in range(2)]
    in_flight: deque[tuple[memoryview, Future]] = deque()
    done = 0

    def hash_oldest() -> bool:
        nonlocal done
        buffer, future = in_flight.popleft()
        n = future.result()
        hasher.update(buffer[:n])
        done += n
        return n == len(buffer)

    for i, start in enumerate(range(0, length, CHUNK_BYTES)):
        buffer = buffers[i % 2][: min(CHUNK_BYTES, length - start)]
        in_flight.append((buffer, io.submit(_pread_into, fd, buffer, offset + start)))
        if len(in_flight) == 2 and not hash_oldest():
            break
    while in_flight:
        if not hash_oldest():
            for _, future in in_flight:
                future.result()
            break
    return done
