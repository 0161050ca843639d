"""Mamba-2 state-space duality (SSD) in plain torch: the chunked scan and the one-token update.

This is the reference path (CPU, and the oracle the GPU kernels are checked against). Both
functions implement the same recurrence per head ``h`` (state ``[p, n]``)::

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * outer(x_t, B_t)
    y_t     = state_t @ C_t + D_h * x_t

where ``B``/``C`` are shared by the heads of a group (``nheads // ngroups`` consecutive heads
per group). ``dt`` is the discretization step already passed through bias and softplus.
Computation runs in fp32; outputs come back in ``x``'s dtype, states in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron.core.ssm.mixer_reference import rowwise


def _heads_from_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """Expand ``[..., ngroups, n]`` to ``[..., nheads, n]`` (each group feeds consecutive heads)."""
    ngroups = t.shape[-2]
    if nheads % ngroups:
        raise ValueError(f"number of heads ({nheads}) must be divisible by number of groups ({ngroups})")
    return t.repeat_interleave(nheads // ngroups, dim=-2)


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the SSD recurrence over a whole sequence, chunk by chunk.

    Inside a chunk the output is a masked ("attention-like") product; across chunks only the
    per-chunk states are carried, so the Python loop is over ``seq_len / chunk_size`` chunks.

    Args:
        x: ``[b, l, h, p]`` inputs per head.
        dt: ``[b, l, h]`` positive step sizes.
        A: ``[h]`` (negative) decay rates.
        B, C: ``[b, l, g, n]`` input and output projections per group.
        chunk_size: chunk length (the sequence is zero-padded to a multiple; padding has
            ``dt = 0`` and so changes neither outputs nor the final state).
        D: optional ``[h]`` skip connection.
        initial_state: optional ``[b, h, p, n]`` state before the first token.

    Returns:
        ``(y [b, l, h, p], final_state [b, h, p, n])``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, seq_len, nheads, head_dim = x.shape
    out_dtype = x.dtype
    pad = (-seq_len) % chunk_size
    xf, dtf = x.float(), dt.float()
    Bh = _heads_from_groups(B.float(), nheads)
    Ch = _heads_from_groups(C.float(), nheads)
    if pad:
        xf, dtf, Bh, Ch = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (xf, dtf, Bh, Ch))
    nchunks = xf.shape[1] // chunk_size

    def chunked(t):
        return t.reshape(batch, nchunks, chunk_size, *t.shape[2:])

    xc, dtc, Bc, Cc = chunked(xf), chunked(dtf), chunked(Bh), chunked(Ch)
    log_decay = torch.cumsum(dtc * A.float(), dim=2)  # [b, c, q, h]: log of decay since chunk start
    x_dt = xc * dtc.unsqueeze(-1)  # [b, c, q, h, p]

    # Within a chunk: y_i += sum_{j<=i} exp(log_decay_i - log_decay_j) (C_i . B_j) dt_j x_j
    diff = log_decay.unsqueeze(3) - log_decay.unsqueeze(2)  # [b, c, i, j, h]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    # Mask before exp: above the diagonal the difference is positive and could overflow.
    weights = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
    scores = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc) * weights
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, x_dt)

    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(log_decay[:, :, -1:] - log_decay)  # [b, c, q, h]
    chunk_states = torch.einsum("bcqhn,bcqh,bcqhp->bchpn", Bc, to_end, x_dt)
    chunk_decay = torch.exp(log_decay[:, :, -1])  # [b, c, h]

    state = (
        initial_state.float()
        if initial_state is not None
        else torch.zeros(batch, nheads, head_dim, Bh.shape[-1], dtype=torch.float32, device=x.device)
    )
    start_states = []
    for c in range(nchunks):
        start_states.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    start = torch.stack(start_states, dim=1)  # [b, c, h, p, n]

    # Carried-in state seen from position i: decayed by exp(log_decay_i), read out by C_i.
    y = y + torch.einsum("bcqhn,bchpn->bcqhp", Cc, start) * torch.exp(log_decay).unsqueeze(-1)
    y = y.reshape(batch, nchunks * chunk_size, nheads, head_dim)[:, :seq_len]
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(out_dtype), state


class StepFactors(NamedTuple):
    """The per-token factors of the one-token update (everything but the recurrence itself),
    for ``N`` rows at once: :func:`ssd_advance` takes them a few rows at a time."""

    decay: torch.Tensor  # [N, h, 1, 1] exp(dt * A)
    dx: torch.Tensor  # [N, h, p, 1] dt * x (fp32)
    B: torch.Tensor  # [N, h, 1, n] (fp32, the group's B of each head)
    C: torch.Tensor  # [N, h, 1, n]
    skip: torch.Tensor | None  # [N, h, p] D * x (fp32), or None without D
    out_dtype: torch.dtype

    def rows(self, index: torch.Tensor | slice) -> StepFactors:
        """The factors of rows ``index`` (a slice gives views; the values are the same)."""
        return StepFactors(*(None if t is None else t[index] for t in self[:5]), self.out_dtype)


def ssd_step_factors(x, dt, A, B, C, D=None) -> StepFactors:
    """:class:`StepFactors` of tokens ``x [N, h, p]``, ``dt [N, h]`` (positive), ``A [h]``,
    ``B, C [N, g, n]``, ``D [h]``. Every op is elementwise and row invariant (or a copy), so a
    row's factors have the same bits whatever ``N``."""
    nheads = x.shape[1]
    dtf = dt.float()
    xf = x.float()
    decay = rowwise(torch.exp, dtf * A.float())[:, :, None, None]  # each row alike whatever N
    skip = None if D is None else xf * D.float()[:, None]
    Bh = _heads_from_groups(B.float(), nheads)
    Ch = _heads_from_groups(C.float(), nheads)
    dx = (dtf[:, :, None] * xf)[..., None]
    return StepFactors(decay, dx, Bh[:, :, None, :], Ch[:, :, None, :], skip, x.dtype)


def ssd_advance(state: torch.Tensor, factors: StepFactors) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [b, h, p], new_state [b, h, p, n] fp32)`` of one token per row from ``state [b, h, p, n]``
    and its rows' ``factors``; ``state`` is not modified."""
    # Elementwise products and a sum over n, not einsum: its batched matmul computes one row
    # differently from many (a decode row must not depend on the batch).
    new_state = factors.decay * state.float() + factors.dx * factors.B
    y = (new_state * factors.C).sum(-1)
    if factors.skip is not None:
        y = y + factors.skip
    return y.to(factors.out_dtype), new_state


# fp32 elements of new states :func:`ssd_recurrence` keeps at once (1 MiB, so a run's states stay
# in cache; a budget of 32 MiB made fully padded prefill steps 3x slower on a 2-core CPU): its
# calls run in runs whose rows fit, each run's outputs read from its states after its last call.
HISTORY_ELEMENTS = 1 << 18


def rows_left(active: list[int]) -> list[int]:
    """Per call of a token-by-token run whose calls have ``active[j]`` real rows (a shrinking
    prefix), the real rows left after it: rows ``[left[j], active[j])`` end in call ``j``."""
    return [*active[1:], 0]


def ssd_recurrence(
    state: torch.Tensor, factors: StepFactors, calls: list[slice], active: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_advance` call after call, with its bits: call ``j`` advances the first
    ``calls[j].stop - calls[j].start`` rows of the working states (``state [R, h, p, n]`` at
    first, not modified) by the tokens of ``factors.rows(calls[j])``, rows of consecutive slices
    of ``G`` tokens, none wider than the one before; ``active[j]`` of its rows are real, a prefix
    that does not grow.

    Returns ``(y [G, h, p] in the factors' output dtype, final [active[0], h, p, n])``: every
    token's output, and each real row's state after its last real call (later calls may still
    carry it as a padding row).

    Per call only the recurrence runs, ``decay * state`` then ``+ dx * B`` (that product made for
    all tokens of a run at once), into the run's buffer of new states; the outputs ``(state *
    C).sum(-1) + D * x`` of a run's tokens come from that buffer in one pass. Every op is the one
    :func:`ssd_advance` makes, elementwise or a sum over ``n`` per row, so each row gets its bits."""
    final = state.new_empty(active[0] if active else 0, *state.shape[1:], dtype=torch.float32)
    total = calls[-1].stop if calls else 0
    y = torch.empty(total, *factors.dx.shape[1:3], dtype=factors.out_dtype, device=state.device)
    limit = max(HISTORY_ELEMENTS // max(state[0].numel(), 1), 1)
    ends = rows_left(active)
    current, first = state.float(), 0
    # decay * state of a call, before it is added: calls only shrink, so the first one is the widest
    scratch = torch.empty_like(current[: calls[0].stop - calls[0].start]) if calls else None
    while first < len(calls):
        start = calls[first].start
        last = first + 1
        while last < len(calls) and calls[last].stop - start <= limit:
            last += 1
        stop = calls[last - 1].stop
        run = factors.rows(slice(start, stop))
        states = run.dx * run.B  # [rows, h, p, n]; each call adds decay * state to its rows
        for index in range(first, last):
            lo, hi = calls[index].start - start, calls[index].stop - start
            product = torch.mul(run.decay[lo:hi], current[: hi - lo], out=scratch[: hi - lo])
            current = states[lo:hi].add_(product)
            if ends[index] < active[index]:
                final[ends[index] : active[index]] = current[ends[index] : active[index]]
        outputs = (states * run.C).sum(-1)
        if run.skip is not None:
            outputs = outputs + run.skip
        y[start:stop] = outputs
        first = last
    return y, final


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance the SSD recurrence by one token.

    Args:
        state: ``[b, h, p, n]`` state after the previous token.
        x: ``[b, h, p]``; dt: ``[b, h]`` (positive); A: ``[h]``; B, C: ``[b, g, n]``; D: ``[h]``.

    Returns:
        ``(y [b, h, p] in x's dtype, new_state [b, h, p, n] fp32)``; ``state`` is not modified.
    """
    return ssd_advance(state, ssd_step_factors(x, dt, A, B, C, D))
