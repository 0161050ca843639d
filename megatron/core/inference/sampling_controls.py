"""Per-request changes of the logits before sampling, with vLLM's semantics, batched on the device.

For a sampled row of a request with :class:`~megatron.core.inference.sampling.SamplingParams`
``p``, whose generated tokens so far (the accepted ones, then the drafts before the row's
speculative depth) are ``g`` and whose prompt is ``x``, in this order:

1. ``logit_bias``: ``logit[t] += p.logit_bias[t]``;
2. ``min_tokens``: while ``len(g) < p.min_tokens`` the logits of EOS (unless ``ignore_eos``) and of
   ``p.stop_token_ids`` are ``-inf``;
3. repetition penalty over ``x + g``: a seen token's logit is divided by ``r`` when positive,
   multiplied by ``r`` otherwise;
4. frequency and presence penalties over ``g``: ``logit[t] -= f * count_g(t) + c * (count_g(t) > 0)``.

Every operation is per row (nothing reduces across rows), so a request's logits do not depend
on the rest of its batch. The counts come from :class:`TokenCounts`: one ``[max_requests, V]``
int32 count tensor and one bool prompt-presence tensor, allocated once (at the first request
with a penalty) at a fixed address, each request holding one row while it samples. A row is
brought up to date on the device from the host's token lists (only the tokens not counted yet
are copied), so it stays right through overlapped steps, pauses, evictions and handoffs:
nothing is read back. Dense rows rather than a sparse scheme: the scatter and gather are one
kernel each and the memory (5 bytes per vocabulary entry per request slot, e.g. 160 MiB for
256 slots of a 128k vocabulary) is reserved only when penalties are used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron.core.inference.host_copies import to_device
from megatron.core.inference.sampling import SamplingParams


@dataclass(frozen=True)
class ControlRow:
    """What the controls of one sampled row need from the host.

    ``generated``: the request's accepted tokens (a list the engine appends to; ``TokenCounts``
    counts only its new tail), ``drafts``: the speculative tokens before this row's depth.
    """

    request_id: str
    params: SamplingParams
    prompt: Sequence[int]
    generated: Sequence[int]
    drafts: Sequence[int] = ()

    @property
    def num_generated(self) -> int:
        return len(self.generated) + len(self.drafts)


class TokenCounts:
    """Per-request token counts on the device (see module doc).

    Args:
        num_slots: rows of the count tensors (the engine's most requests in its context: every
            sampled row belongs to one of them).
        vocab_size: logits width.
        device: where the logits are.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str):
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None  # [num_slots, V] int32: generated-token counts
        self.seen_in_prompt: torch.Tensor | None = None  # [num_slots, V] bool
        self._slots: dict[str, tuple[int, int]] = {}  # request id -> (slot, tokens counted)
        self._free = list(range(num_slots - 1, -1, -1))

    def release(self, request_id: str) -> None:
        """Give the request's row back (it finished or left); unknown ids are ignored."""
        entry = self._slots.pop(request_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def rows_for(self, rows: Sequence[ControlRow]) -> torch.Tensor:
        """The slot of each row's request [len(rows)] on the device, after counting what each
        request generated since its previous call (and its prompt, on a fresh slot)."""
        if self.counts is None:
            shape = (self.num_slots, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.seen_in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        wanted = {row.request_id for row in rows}
        missing = len(wanted - self._slots.keys())
        if missing > len(self._free):
            # Requests not sampled now (paused, evicted) lose their rows; they rebuild on return.
            for request_id in [r for r in self._slots if r not in wanted]:
                self.release(request_id)
        fresh, prompt_pairs, new_counts, slots = [], [], [], []
        for row in rows:
            entry = self._slots.get(row.request_id)
            if entry is None:
                entry = (self._free.pop(), 0)
                fresh.append(entry[0])
                prompt_pairs += [(entry[0], t) for t in row.prompt]
            slot, counted = entry
            new_counts += [(slot, t) for t in row.generated[counted:]]
            self._slots[row.request_id] = (slot, len(row.generated))
            slots.append(slot)
        if fresh:
            index = to_device(torch.tensor(fresh), self.device)
            self.counts.index_fill_(0, index, 0)
            self.seen_in_prompt.index_fill_(0, index, False)
            self._scatter(self.seen_in_prompt, prompt_pairs)
        if new_counts:
            self._scatter(self.counts, new_counts)
        return to_device(torch.tensor(slots), self.device)

    @staticmethod
    def _scatter(target: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Add one at each (slot, token) of ``pairs`` (bool targets: set it)."""
        index = to_device(torch.tensor(pairs, dtype=torch.long), target.device)
        ones = torch.ones(len(pairs), dtype=target.dtype, device=target.device)
        target.index_put_((index[:, 0], index[:, 1]), ones, accumulate=target.dtype != torch.bool)


def apply_logit_bias_and_min_tokens(logits: torch.Tensor, rows: Sequence[ControlRow], eos_token_id: int | None) -> None:
    """Steps 1 and 2 of the module doc on ``logits`` [len(rows), V] (fp32, in place): one
    sparse add of every row's biases and EOS masks."""
    entries = []  # (row, token, value)
    if eos_token_id is not None and not 0 <= eos_token_id < logits.shape[-1]:
        eos_token_id = None  # an EOS the model cannot emit needs no mask
    for i, row in enumerate(rows):
        params = row.params
        entries += [(i, token, bias) for token, bias in params.logit_bias]
        if row.num_generated < params.min_tokens:
            ends = set(params.stop_token_ids)
            if eos_token_id is not None and not params.ignore_eos:
                ends.add(eos_token_id)
            entries += [(i, token, -math.inf) for token in sorted(ends)]
    if not entries:
        return
    packed = to_device(torch.tensor(entries, dtype=torch.float64), logits.device)
    index = packed[:, :2].long()
    logits.index_put_((index[:, 0], index[:, 1]), packed[:, 2].to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[ControlRow], counts: TokenCounts) -> None:
    """Steps 3 and 4 of the module doc on ``logits`` [len(rows), V] (fp32, in place), for the
    rows with a penalty."""
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalized:
        return
    chosen = [rows[i] for i in penalized]
    device = logits.device
    slots = counts.rows_for(chosen)
    generated = counts.counts.index_select(0, slots)  # [m, V]
    drafts = [(i, t) for i, row in enumerate(chosen) for t in row.drafts]
    if drafts:
        index = to_device(torch.tensor(drafts, dtype=torch.long), device)
        generated.index_put_((index[:, 0], index[:, 1]), torch.ones_like(index[:, 0], dtype=generated.dtype), True)
    factors = to_device(
        torch.tensor(
            [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in chosen],
            dtype=torch.float32,
        ),
        device,
    )
    repetition, frequency, presence = (factors[:, i, None] for i in range(3))
    row_index = to_device(torch.tensor(penalized), device)
    values = logits.index_select(0, row_index)
    appeared = generated > 0
    seen = counts.seen_in_prompt.index_select(0, slots) | appeared
    values = torch.where(seen, torch.where(values > 0, values / repetition, values * repetition), values)
    values = values - frequency * generated.to(values.dtype) - presence * appeared.to(values.dtype)
    logits.index_copy_(0, row_index, values)


def apply_sampling_controls(
    logits: torch.Tensor, rows: Sequence[ControlRow], counts: TokenCounts, eos_token_id: int | None
) -> None:
    """The whole module doc on ``logits`` [len(rows), V] (fp32, in place); rows without controls
    are left as they are."""
    apply_logit_bias_and_min_tokens(logits, rows, eos_token_id)
    apply_penalties(logits, rows, counts)
