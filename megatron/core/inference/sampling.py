"""Sampling parameters of a request, batched token sampling and log-probabilities.

Each row of a batch is sampled from its own distribution with its own ``torch.Generator``:
a non-greedy row consumes exactly one uniform number from its generator per call and
nothing else, so a request with a seed produces the same tokens whatever else is in the
batch, and whether or not it was paused or evicted in between.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron.core.errors import MegatronInputError
from megatron.core.inference.stop_words import normalize_stop_sequences

MAX_TOP_LOGPROBS = 20
_SEED_LIMIT = 2**64


class InvalidSamplingParamsError(MegatronInputError):
    """A sampling parameter out of its accepted range; the message names it."""


class SamplingInputError(MegatronInputError):
    """``sample`` got logits, parameters and generators that do not line up."""


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator: seeded from ``seed``, or from fresh entropy when it is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


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


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Pick one token per row of ``logits`` [n, V] with that row's parameters and generator.

    Greedy rows take the argmax (first on ties) and draw nothing. Other rows draw one uniform
    number from their generator (the default generator when None) and invert the cumulative
    distribution of :func:`filtered_probs`. Returns int64 token ids [n].
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise SamplingInputError(
            f"sample needs logits [n, V] with one SamplingParams and one generator (or None) per row; got "
            f"logits of shape {tuple(logits.shape)}, {len(params)} params and {len(generators)} generators"
        )
    tokens = logits.argmax(dim=-1)
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    chosen = [params[row] for row in rows]
    probs = filtered_probs(
        logits[torch.tensor(rows, device=device)],
        torch.tensor([p.temperature for p in chosen], device=device),
        torch.tensor([p.top_k for p in chosen], device=device),
        torch.tensor([p.top_p for p in chosen], device=device),
    )
    uniforms = torch.stack([_uniform(generators[row], device) for row in rows])
    cdf = probs.double().cumsum(dim=-1)
    targets = (uniforms.double() * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
    tokens[torch.tensor(rows, device=device)] = picked
    return tokens


def _uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    draw_device = generator.device if generator is not None else device
    return torch.rand((), generator=generator, device=draw_device).to(device)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability [n] of ``tokens`` [n] under the raw (unfiltered) ``logits`` [n, V], in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.long()[:, None]).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probabilities per row and their token ids, each [n, k], most likely first."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def prompt_logprobs(logits: torch.Tensor, prompt_tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability [s - 1] of prompt tokens 1..s-1, from the prompt's logits [s, V] (position i predicts i + 1)."""
    return token_logprobs(logits[:-1], prompt_tokens[1:])
