"""The sizes a step is padded to, and the check that keeps padding batch invariant.

A step of ``n`` tokens runs at the smallest bucket ``>= n``: powers of two up to
``max_tokens_per_step``, the request cap and ``max_tokens_per_step`` itself. Decode steps of the
CUDA-graph path use the same buckets (one graph each), so a decode step has the same shapes with
graphs and without.

Padding keeps outputs independent of batch composition only if every kernel computes a row the
same way whatever the number of rows. Attention and the per-row ops are built that way; the
linear layers are GEMMs from the backend (MKL on CPU, cuBLAS or the batch-invariant kernels on
GPU), which may pick their blocking (and with it the rounding of a row) by the number of rows:
MKL, for one, computes a row differently for 1, for 2-8 and for 16 or more rows, and with
several threads may split large shapes differently again. The Mamba mixers' decode step runs
its one-token recurrence over all the step's rows at once, so it is checked the same way.
:func:`row_invariant_buckets` runs each linear layer and each Mamba mixer's decode step (from
random states) once at every candidate size and keeps the sizes whose rows (outputs and new
states) are bitwise those of the largest one; every rank of the model-parallel group keeps the
sizes all of them kept.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def candidate_buckets(max_tokens: int, max_requests: int | None = None) -> list[int]:
    """Powers of two below ``max_tokens``, ``max_requests`` (when smaller) and ``max_tokens``."""
    sizes = {1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens} | {max_tokens}
    if max_requests is not None and max_requests < max_tokens:
        sizes.add(max_requests)
    return sorted(sizes)


class StepBuckets:
    """Sorted step sizes; :meth:`pad` gives the bucket of a step."""

    def __init__(self, sizes: list[int]):
        if not sizes:
            raise ValueError("a step needs at least one bucket size")
        self.sizes = sorted(set(sizes))

    def pad(self, num_tokens: int) -> int:
        """The smallest bucket that holds ``num_tokens`` tokens."""
        index = bisect.bisect_left(self.sizes, num_tokens)
        if index == len(self.sizes):
            raise ValueError(f"a step of {num_tokens} tokens exceeds the largest bucket {self.sizes[-1]}")
        return self.sizes[index]

    def __repr__(self) -> str:
        return f"StepBuckets({self.sizes})"


@dataclass(frozen=True)
class _DecodeRows:
    """The step facts a mixer's packed decode step reads (one token per row, no padding)."""

    request_ids: tuple
    cu_query_lengths: torch.Tensor
    query_lengths: torch.Tensor
    num_tokens: int
    decode_only: bool = True


class _MambaDecodeCheck:
    """A Mamba inference context for one decode step of ``rows`` requests over private copies of
    the first ``rows`` of the given states (both hooks of the mixer's packed step served)."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, rows: int):
        self.conv, self.ssm = conv[:rows].clone(), ssm[:rows].clone()
        self.slot_ids = torch.arange(rows, device=conv.device)
        lengths = torch.ones(rows, dtype=torch.long, device=conv.device)
        cu = torch.arange(rows + 1, device=conv.device)
        self.step = _DecodeRows(tuple(range(rows)), cu, lengths, rows)

    def is_decode_only(self) -> bool:
        return True

    def mamba_states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.ssm

    def mamba_state_slots(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.conv, self.ssm, self.slot_ids


def _mamba_decode_rows(
    mixer: MambaMixer, hidden: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [rows, h], conv, ssm)`` of ``mixer``'s decode step over the first ``rows`` rows."""
    context = _MambaDecodeCheck(conv, ssm, rows)
    out, _ = mixer(hidden[:rows], inference_context=context)
    return out[:, 0], context.conv, context.ssm


@torch.no_grad()
def row_invariant_buckets(
    model: nn.Module, candidates: list[int], pg_collection: ProcessGroupCollection | None = None
) -> list[int]:
    """The candidates at which every linear layer of ``model`` gives, row for row, bitwise the
    output it gives at the largest candidate (always kept). Every rank of the model-parallel
    group must call it (they agree on the result over ``tp`` and ``pp``)."""
    largest = max(candidates)
    keep = torch.ones(len(candidates), dtype=torch.int64)
    generator = torch.Generator().manual_seed(0)
    # Every layer, not one per shape: a layer whose weight happens to make the check trivial (all
    # zeros) must not stand for the others.
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        weight = module.weight
        inputs = torch.randn(largest, 1, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
        reference = module(inputs)[0]
        for index, size in enumerate(candidates):
            # Every rank runs every call (a row-parallel layer all-reduces over TP).
            if size != largest and not torch.equal(module(inputs[:size])[0], reference[:size]):
                keep[index] = 0
    for module in model.modules():
        if not isinstance(module, MambaMixer):
            continue
        weight = module.in_proj.weight
        hidden = torch.randn(largest, 1, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
        conv, ssm = (
            torch.randn(largest, *shape, generator=generator).to(weight.device)
            for shape in (module.dims.conv_state_shape(), module.dims.ssm_state_shape())
        )
        reference = _mamba_decode_rows(module, hidden, conv, ssm, largest)
        for index, size in enumerate(candidates):
            if size != largest:
                rows = _mamba_decode_rows(module, hidden, conv, ssm, size)
                if not all(torch.equal(got, want[:size]) for got, want in zip(rows, reference, strict=True)):
                    keep[index] = 0
    for name in ("tp", "pp"):  # the minimum over tp, then over pp: over the whole replica
        if pg_collection is not None and pg_collection.size(name) > 1:
            group = getattr(pg_collection, name)
            nccl = dist.get_backend(group) == "nccl"
            keep = keep.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
            dist.all_reduce(keep, dist.ReduceOp.MIN, group=group)
    return [size for size, kept in zip(candidates, keep.tolist(), strict=True) if kept]
