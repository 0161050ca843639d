"""Random number generation for parallel models.

* :func:`init_rng_scope` gives weight initialization a CPU RNG seeded from ``(init_seed, key)``
  so that every layout builds identical full weights.
* :class:`RNGStatesTracker` keeps named RNG streams (CPU and, when present, CUDA) that dropout
  in tensor-parallel regions forks into; :func:`model_parallel_manual_seed` seeds them.
* :func:`checkpoint` recomputes a function's activations in backward with the RNG states
  (default and tracked) that its forward saw.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator

import torch

from megatron.core.errors import MegatronInputError
from megatron.core.parallel_state import resolve_pg_collection

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset between the shared seed and the per-TP-rank model-parallel seed (Megatron's value).
_MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGTrackerError(MegatronInputError):
    """A named RNG stream was added twice, or forked without being added."""


def derive_seed(seed: int, key: str) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``key`` (stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def init_rng_scope(config, key: str) -> Iterator[None]:
    """Scope for creating the weights named ``key`` (e.g. ``"layer3"``, ``"embedding"``).

    When ``config.layout_invariant_init`` is set, the CPU RNG is forked and seeded from
    ``(config.init_seed, key)``; the caller's RNG state is restored on exit. Parallel layers built
    inside create their full master weight from this RNG and keep their slice, so the same seed
    gives the same full weights under any TP/GTP/PP layout. Otherwise this is a no-op.
    """
    if not getattr(config, "layout_invariant_init", False):
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(config.init_seed, key))
        yield


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_states() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda_ready() else None)


def _set_states(states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None and _cuda_ready():
        torch.cuda.set_rng_state(cuda)


class RNGStatesTracker:
    """Named RNG streams; :meth:`fork` runs a block on one stream and advances only it."""

    def __init__(self) -> None:
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def reset(self) -> None:
        """Forget every stream."""
        self._states = {}

    def names(self) -> list[str]:
        return list(self._states)

    def get_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """A copy of every stream's (CPU, CUDA) state."""
        return dict(self._states)

    def set_states(self, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Replace every stream's state (the inverse of :meth:`get_states`)."""
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; the caller's RNG state is untouched."""
        if name in self._states:
            raise RNGTrackerError(f"RNG stream {name!r} already exists; call reset() before re-adding it")
        saved = _get_states()
        torch.manual_seed(seed)
        self._states[name] = _get_states()
        _set_states(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with stream ``name`` as the default RNG, then restore the caller's RNG."""
        if name not in self._states:
            raise RNGTrackerError(f"RNG stream {name!r} was not added; known streams: {self.names()}")
        saved = _get_states()
        _set_states(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_states()
            _set_states(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide RNG tracker."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, pg_collection=None) -> None:
    """Seed the default RNG with ``seed`` (same on every TP rank: dropout on replicated
    activations agrees) and the tracker's ``model-parallel-rng`` stream with a seed that differs
    per TP rank (dropout on TP-sharded activations draws independent masks)."""
    tp_rank = resolve_pg_collection(pg_collection).rank("tp")
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.rng_states = _get_states()
        ctx.tracker_states = _TRACKER.get_states()
        with torch.no_grad():
            outputs = run_function(*args)
        tensor_idx = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_idx = tensor_idx
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in tensor_idx))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors, strict=True):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        outer_states, outer_tracker = _get_states(), _TRACKER.get_states()
        _set_states(ctx.rng_states)
        _TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        finally:
            _set_states(outer_states)
            _TRACKER.set_states(outer_tracker)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = [a.grad if torch.is_tensor(a) else None for a in args]
        return (None, *arg_grads)


def checkpoint(function: Callable, *args):
    """Run ``function(*args)`` without keeping its activations; recompute them in backward.

    The recomputation sees the same default and tracked RNG states as the forward did, so
    dropout masks match. Tensor outputs (or a tuple of them) get gradients as usual; the
    parameters used inside get their gradients in the recomputation's backward.
    """
    return _CheckpointFunction.apply(function, *args)
