"""What the last pipeline stage decides in one step, and the fixed tensor layout that carries it
to the other stages.

Only the last stage has logits, so it samples; every stage needs the outcome to keep its
requests, KV bookkeeping and outputs in lockstep. What every stage can derive from the shared
tokens itself (finish reasons: EOS, length, stop sequences, by the same code on the same
tokens) is not sent.

The layout is one int64 tensor whose size every stage knows before the step from its own
(identical) schedule; float64 values travel bit-cast, so log-probabilities arrive bit-exact.
For ``R`` requests, ``T`` tokens and ``D`` next drafts at most per request, ``P_i`` prompt
log-probabilities at most and ``K_i`` top log-probabilities per token for request ``i``::

    counts            [R, 4]      tokens, accepted drafts, next drafts, prompt log-probs
    tokens            [R, T]
    next drafts       [R, D]
    top token ids     [sum T*K_i] request i's [T, K_i] from offset T*(K_0 + ... + K_{i-1})
    log-probs         [R, T]      float64 bits
    top log-probs     [sum T*K_i] float64 bits, laid out as the top token ids
    prompt log-probs  [sum P_i]   float64 bits, request i's from offset P_0 + ... + P_{i-1}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_NUM_COUNTS = 4


@dataclass
class Decision:
    """What the last stage decided for one request in one step (``top_log_probs``: one list of
    ``(token id, log-prob)`` pairs per token when the request asked for them, else empty)."""

    prompt_log_probs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    accepted_drafts: int = 0
    next_drafts: list[int] = field(default_factory=list)
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class DecisionLayout:
    """The sizes of one step's shared decisions (see module doc).

    Args:
        max_tokens: tokens a request may get in one step (1 + the speculative tokens verified).
        max_next_drafts: drafts a request may get for the next step.
        prompt_log_prob_capacity: per scheduled request, how many prompt log-probs it may get
            (its scheduled tokens when it asked for them, else 0).
        top_log_prob_widths: per scheduled request, its ``top_logprobs`` (empty: 0 for all).
    """

    max_tokens: int
    max_next_drafts: int
    prompt_log_prob_capacity: tuple[int, ...]
    top_log_prob_widths: tuple[int, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.prompt_log_prob_capacity)

    @property
    def _widths(self) -> tuple[int, ...]:
        return self.top_log_prob_widths or (0,) * self.num_requests

    @property
    def _num_top(self) -> int:
        return self.max_tokens * sum(self._widths)

    @property
    def _num_ints(self) -> int:
        return self.num_requests * (_NUM_COUNTS + self.max_tokens + self.max_next_drafts) + self._num_top

    @property
    def size(self) -> int:
        """Elements of the packed tensor."""
        return self._num_ints + self.num_requests * self.max_tokens + self._num_top + sum(self.prompt_log_prob_capacity)

    def empty(self) -> torch.Tensor:
        """A tensor to receive the packed decisions into."""
        return torch.empty(self.size, dtype=torch.int64)

    def pack(self, decisions: Sequence[Decision]) -> torch.Tensor:
        """The decisions (one per scheduled request, in order) as one int64 tensor."""
        if len(decisions) != self.num_requests:
            raise ValueError(f"{len(decisions)} decisions for a layout of {self.num_requests} requests")
        counts, tokens, drafts, top_ids, log_probs, top_values, prompt_log_probs = [], [], [], [], [], [], []
        for index, (decision, capacity, width) in enumerate(
            zip(decisions, self.prompt_log_prob_capacity, self._widths, strict=True)
        ):
            num_tokens, num_drafts = len(decision.tokens), len(decision.next_drafts)
            num_prompt = len(decision.prompt_log_probs)
            tops_fit = len(decision.top_log_probs) == (num_tokens if width else 0) and all(
                len(row) == width for row in decision.top_log_probs
            )
            if (
                num_tokens > self.max_tokens
                or num_drafts > self.max_next_drafts
                or num_prompt > capacity
                or len(decision.log_probs) != num_tokens
                or not tops_fit
            ):
                raise ValueError(
                    f"decision {index} ({num_tokens} tokens, {len(decision.log_probs)} log-probs, {num_drafts} "
                    f"drafts, {num_prompt} prompt log-probs, {len(decision.top_log_probs)} top log-prob rows) does "
                    f"not fit the layout (at most {self.max_tokens} tokens with one log-prob each, "
                    f"{self.max_next_drafts} drafts, {capacity} prompt log-probs, {width} top log-probs per token)"
                )
            counts += [num_tokens, decision.accepted_drafts, num_drafts, num_prompt]
            tokens += decision.tokens + [0] * (self.max_tokens - num_tokens)
            drafts += decision.next_drafts + [0] * (self.max_next_drafts - num_drafts)
            log_probs += decision.log_probs + [0.0] * (self.max_tokens - num_tokens)
            for row in decision.top_log_probs:
                top_ids += [t for t, _ in row]
                top_values += [lp for _, lp in row]
            top_ids += [0] * width * (self.max_tokens - len(decision.top_log_probs))
            top_values += [0.0] * width * (self.max_tokens - len(decision.top_log_probs))
            prompt_log_probs += decision.prompt_log_probs + [0.0] * (capacity - num_prompt)
        packed_ints = torch.tensor(counts + tokens + drafts + top_ids, dtype=torch.int64)
        packed_floats = torch.tensor(log_probs + top_values + prompt_log_probs, dtype=torch.float64).view(torch.int64)
        return torch.cat([packed_ints, packed_floats])

    def unpack(self, packed: torch.Tensor) -> list[Decision]:
        """The decisions :meth:`pack` packed (values bit-exact)."""
        if packed.dtype != torch.int64 or packed.shape != (self.size,):
            raise ValueError(f"packed decisions are int64 [{self.size}], got {packed.dtype} {tuple(packed.shape)}")
        packed = packed.cpu()
        num_requests, max_tokens, max_drafts = self.num_requests, self.max_tokens, self.max_next_drafts
        ints = packed[: self._num_ints].tolist()
        floats = packed[self._num_ints :].view(torch.float64).tolist()
        counts_end = num_requests * _NUM_COUNTS
        tokens_end = counts_end + num_requests * max_tokens
        top_start = tokens_end + num_requests * max_drafts
        top_value_start = num_requests * max_tokens
        prompt_start = top_value_start + self._num_top
        decisions = []
        for index, (capacity, width) in enumerate(zip(self.prompt_log_prob_capacity, self._widths, strict=True)):
            num_tokens, accepted, num_drafts, num_prompt = ints[index * _NUM_COUNTS : (index + 1) * _NUM_COUNTS]
            token_start = counts_end + index * max_tokens
            draft_start = tokens_end + index * max_drafts
            log_prob_start = index * max_tokens
            tops = [
                list(
                    zip(
                        ints[top_start + t * width : top_start + (t + 1) * width],
                        floats[top_value_start + t * width : top_value_start + (t + 1) * width],
                        strict=True,
                    )
                )
                for t in range(num_tokens if width else 0)
            ]
            decisions.append(
                Decision(
                    prompt_log_probs=floats[prompt_start : prompt_start + num_prompt],
                    tokens=ints[token_start : token_start + num_tokens],
                    log_probs=floats[log_prob_start : log_prob_start + num_tokens],
                    accepted_drafts=accepted,
                    next_drafts=ints[draft_start : draft_start + num_drafts],
                    top_log_probs=tops,
                )
            )
            prompt_start += capacity
            top_start += max_tokens * width
            top_value_start += max_tokens * width
        return decisions
