"""Sampling parameters of a request, batched token sampling and log-probabilities.

Each row of a batch is sampled from its own distribution with its own counter-based stream
(:class:`CounterGenerator`): the number that picks a request's ``i``-th token is a hash of its
seed and ``i``, so a request with a seed produces the same tokens whatever else is in the batch,
and whether or not it was paused, evicted, speculated or handed over in between. Sampling runs
batched on the logits' device (:func:`sample` with :class:`SamplingRows`) and reads nothing back.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron.core.errors import MegatronInputError
from megatron.core.inference.host_copies import to_device
from megatron.core.inference.stop_words import normalize_stop_sequences
from megatron.core.inference.structured_output.params import StructuredOutputParams

MAX_TOP_LOGPROBS = 20
_SEED_LIMIT = 2**64


class InvalidSamplingParamsError(MegatronInputError):
    """A sampling parameter out of its accepted range; the message names it."""


class SamplingInputError(MegatronInputError):
    """``sample`` / ``SamplingRows`` got logits, parameters, generators or draw indices that do not line up."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Args:
        temperature: >= 0; 0 means greedy (argmax), and then top_k/top_p/seed are unused.
        top_k: keep the k most likely tokens (ties with the k-th are kept too); 0 disables.
        top_p: keep the smallest most-likely set whose probability reaches top_p, in (0, 1];
            1 disables. Applied after top_k, on the temperature-scaled distribution.
        seed: seeds the request's generator (see :func:`make_generator`); None for a random one.
        max_tokens: most tokens to generate, >= 1; None lets the engine's length limit decide.
        stop: stop sequences (a string or a list of non-empty strings), see ``stop_words``.
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: return the log-probability of each generated token.
        top_logprobs: with ``logprobs``, also the this-many most likely tokens, in [0, 20].
        return_prompt_logprobs: return the log-probability of each prompt token after the first.
        structured_output: the grammar the output must match (JSON schema, JSON object, tool
            call; see :mod:`~megatron.core.inference.structured_output`); None for free text.
            Its dict form (``dataclasses.asdict``) is accepted too.

    Raises:
        InvalidSamplingParamsError: for a field out of range (``stop``: InvalidStopSequencesError).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_prompt_logprobs: bool = False
    structured_output: StructuredOutputParams | None = None

    def __post_init__(self):
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParamsError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidSamplingParamsError(f"top_k must be an integer >= 0 (0 disables top-k), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidSamplingParamsError(f"top_p must be a number in (0, 1] (1 disables top-p), got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_LIMIT):
            raise InvalidSamplingParamsError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidSamplingParamsError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        for name in ("ignore_eos", "logprobs", "return_prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParamsError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingParamsError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidSamplingParamsError(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        object.__setattr__(self, "stop", normalize_stop_sequences(self.stop))
        object.__setattr__(self, "structured_output", StructuredOutputParams.coerce(self.structured_output))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class CounterGenerator:
    """The random stream of one request, counter based.

    Draw ``i`` (the one that picks the request's ``i``-th generated token) is a hash of the seed
    and ``i`` (:func:`counter_uniforms`), so a request's tokens depend on nothing but its seed and
    its own logits: not on its batch, its step, pauses, evictions, speculation, or the engine it
    continues on. Nothing advances: a draw needs only the token index, which lets every row of a
    step (and every speculative depth) draw at once on the device. ``get_state`` / ``set_state``
    carry the seed, with the interface of ``torch.Generator`` that a state handoff uses.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self.keys = self._keys(seed)

    @staticmethod
    def _keys(seed: int) -> tuple[int, int]:
        """Two 32-bit keys of the seed, derived once on the host (BLAKE2b, never Python's hash)."""
        if not _is_int(seed) or not 0 <= seed < _SEED_LIMIT:
            raise InvalidSamplingParamsError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        digest = hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=8).digest()
        return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")

    def get_state(self) -> torch.Tensor:
        """The seed as 8 bytes (uint8 CPU tensor)."""
        return torch.frombuffer(bytearray(self.seed.to_bytes(8, "little")), dtype=torch.uint8)

    def set_state(self, state: torch.Tensor) -> None:
        """Continue the stream whose :meth:`get_state` gave ``state``."""
        seed = int.from_bytes(bytes(state.to(torch.uint8).tolist()), "little")
        self.seed, self.keys = seed, self._keys(seed)


def make_generator(seed: int | None) -> CounterGenerator:
    """The per-request generator: seeded from ``seed``, or from fresh entropy when it is None."""
    return CounterGenerator(secrets.randbits(64) if seed is None else seed)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for int64 ``x`` in [0, 2**32), never overflowing int64."""
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche), in int64 arithmetic."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def counter_uniforms(keys: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Uniform float64 numbers in [0, 1) [n], one per row: a hash of the row's generator keys
    ``keys [n, 2]`` (:attr:`CounterGenerator.keys`) and its draw index ``draws [n]`` (< 2**32).
    The same keys and index give the same number on every device and in every batch."""
    h = _mix32((draws & _MASK32) ^ keys[:, 0])
    high = _mix32(h ^ keys[:, 1])
    low = _mix32(high ^ keys[:, 0] ^ 0x9E3779B9)
    return (((high >> 6) << 27) | (low >> 5)).double() * 2.0**-53


@dataclass(frozen=True)
class SamplingRows:
    """The per-row parameters of a batch of logits rows ``[n, V]``, on the logits' device.

    Only the rows that draw (temperature > 0) have parameters: ``drawing_rows [m]`` indexes
    them, the other tensors are ``[m]`` (``keys [m, 2]``). Built on the host in one copy to the
    device (:meth:`build`), without reading anything back.
    """

    num_rows: int
    drawing_rows: torch.Tensor | None  # None: every row is greedy
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    keys: torch.Tensor | None
    draws: torch.Tensor | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[CounterGenerator | None],
        draws: Sequence[int],
        device: torch.device | str,
    ) -> SamplingRows:
        """Rows ``i`` sample with ``params[i]``; the drawing ones use ``generators[i]`` at draw
        index ``draws[i]`` (the index of the generated token the row picks)."""
        if not len(params) == len(generators) == len(draws):
            raise SamplingInputError(
                f"SamplingRows needs one SamplingParams, generator and draw index per row; got {len(params)}, "
                f"{len(generators)} and {len(draws)}"
            )
        drawing = [row for row, p in enumerate(params) if not p.greedy]
        if not drawing:
            return cls(len(params), None, None, None, None, None, None)
        if any(generators[row] is None for row in drawing):
            raise SamplingInputError("every row with temperature > 0 needs a generator")
        # float64 holds every field exactly (keys < 2**32, indices and top_k are small integers).
        packed = torch.tensor(
            [
                [row, params[row].temperature, params[row].top_k, params[row].top_p, *generators[row].keys, draws[row]]
                for row in drawing
            ],
            dtype=torch.float64,
        )
        packed = to_device(packed, device)
        ints = packed[:, [0, 2, 4, 5, 6]].long()
        return cls(
            len(params),
            drawing_rows=ints[:, 0],
            temperature=packed[:, 1].float(),
            top_k=ints[:, 1],
            top_p=packed[:, 3].float(),
            keys=ints[:, 2:4],
            draws=ints[:, 4],
        )


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row distribution after temperature, top-k, then top-p; fp32, in vocabulary order.

    Args:
        logits: [n, V]; temperature: [n] (> 0); top_k: [n] (0 = off); top_p: [n] (1 = off).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    # Shift by the max first so that a tiny temperature cannot overflow.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature.float()[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(order.device)
    kth_logit = sorted_logits.gather(1, (k - 1)[:, None])
    keep = sorted_logits >= kth_logit
    sorted_probs = sorted_logits.masked_fill(~keep, -math.inf).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 must keep everything even where rounding lets the running mass reach 1.
    keep &= (mass_before < top_p.float()[:, None]) | (top_p >= 1)[:, None]
    sorted_probs = sorted_logits.masked_fill(~keep, -math.inf).softmax(dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Pick one token per row of ``logits`` [n, V] with the rows' parameters (:class:`SamplingRows`).

    Greedy rows take the argmax (first on ties) and draw nothing. The others invert the
    cumulative distribution of :func:`filtered_probs` at their :func:`counter_uniforms` number.
    Runs on the logits' device without reading anything back. Returns int64 token ids [n].
    """
    if logits.dim() != 2 or logits.shape[0] != rows.num_rows:
        raise SamplingInputError(
            f"sample needs logits [n, V] with one row of parameters per logits row; got logits of shape "
            f"{tuple(logits.shape)} and {rows.num_rows} rows of parameters"
        )
    tokens = logits.argmax(dim=-1)
    if rows.drawing_rows is None:
        return tokens
    probs = filtered_probs(logits.index_select(0, rows.drawing_rows), rows.temperature, rows.top_k, rows.top_p)
    cdf = probs.double().cumsum(dim=-1)
    targets = (counter_uniforms(rows.keys, rows.draws) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
    return tokens.index_copy(0, rows.drawing_rows, picked)


class LogitsProcessor(Protocol):
    """A per-request change of the logits before sampling (grammar masks, logit bias,
    penalties, min_tokens): called with the sampling rows' fp32 logits ``[n, V]`` (a copy the
    engine owns; change it in place, on its device, e.g. by adding a batched bias or mask
    tensor, without reading values back to the host) and the request id of each row. Log-probs
    are those of the model's logits, taken before processors run."""

    def __call__(self, logits: torch.Tensor, request_ids: Sequence[str]) -> None: ...


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability [n] of ``tokens`` [n] under the raw (unfiltered) ``logits`` [n, V], in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.long()[:, None]).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probabilities per row and their token ids, each [n, k], most likely first."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def prompt_logprobs(logits: torch.Tensor, prompt_tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability [s - 1] of prompt tokens 1..s-1, from the prompt's logits [s, V] (position i predicts i + 1)."""
    return token_logprobs(logits[:-1], prompt_tokens[1:])
