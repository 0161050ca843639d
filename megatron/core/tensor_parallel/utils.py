"""Small shape helpers shared by the tensor-parallel modules (no communication here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.core.errors import MegatronConfigError


class TensorParallelError(MegatronConfigError):
    """A size or argument that cannot be split over tensor/generalized-tensor parallel ranks."""


def divide(numerator: int, denominator: int, what: str, by: str = "tensor_model_parallel_size") -> int:
    """``numerator // denominator``; raises TensorParallelError naming ``what`` and ``by`` when it
    does not divide."""
    if numerator % denominator:
        raise TensorParallelError(f"{what} ({numerator}) must be divisible by {by} ({denominator})")
    return numerator // denominator


def pad_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Smallest multiple of ``divisible_by * tp_size`` that is >= ``vocab_size`` (Megatron's rule)."""
    if vocab_size < 1 or tp_size < 1 or divisible_by < 1:
        raise TensorParallelError(
            f"pad_vocab_size needs positive integers, got vocab_size={vocab_size}, tp_size={tp_size}, "
            f"divisible_by={divisible_by}"
        )
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def vocab_range(global_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[first, last)`` token ids held by ``tp_rank`` of a vocabulary split evenly over ``tp_size``."""
    per_rank = divide(global_vocab_size, tp_size, "vocabulary size")
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def split_along_dim(tensor: torch.Tensor, dim: int, num_parts: int, index: int) -> torch.Tensor:
    """Contiguous ``index``-th of ``num_parts`` equal chunks of ``tensor`` along ``dim``."""
    if tensor.shape[dim] % num_parts:
        raise TensorParallelError(
            f"cannot split dimension {dim} (size {tensor.shape[dim]}) of a tensor of shape {tuple(tensor.shape)} "
            f"into {num_parts} equal parts; the size must be a multiple of {num_parts}"
        )
    size = tensor.shape[dim] // num_parts
    return tensor.narrow(dim, index * size, size).contiguous()


def pack_tp_slice(
    full: torch.Tensor, dim: int, part_sizes: Sequence[int] | None, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's slice of ``full`` along ``dim``: each packed part is split separately and
    the parts' slices are concatenated (Q,K,V or Mamba z,x,B,C,dt keep their order per rank)."""
    parts = _split_parts(full, dim, part_sizes)
    return torch.cat([split_along_dim(p, dim, tp_size, tp_rank) for p in parts], dim=dim)


def unpack_tp_gathered(
    gathered: torch.Tensor, dim: int, part_sizes: Sequence[int] | None, tp_size: int
) -> torch.Tensor:
    """Inverse of :func:`pack_tp_slice` over all ranks: ``gathered`` is the concatenation of the
    ranks' packed slices along ``dim``; returns the full tensor with the parts in global order."""
    if not part_sizes or tp_size == 1:
        return gathered
    per_rank = gathered.chunk(tp_size, dim=dim)
    local_sizes = [divide(s, tp_size, "packed partition size") for s in part_sizes]
    pieces = [r.split(local_sizes, dim=dim) for r in per_rank]
    return torch.cat([pieces[rank][part] for part in range(len(part_sizes)) for rank in range(tp_size)], dim=dim)


def _split_parts(full: torch.Tensor, dim: int, part_sizes: Sequence[int] | None) -> list[torch.Tensor]:
    if not part_sizes:
        return [full]
    if sum(part_sizes) != full.shape[dim]:
        raise TensorParallelError(
            f"packed partition sizes {list(part_sizes)} sum to {sum(part_sizes)}, but dimension {dim} has "
            f"size {full.shape[dim]}"
        )
    return list(full.split(list(part_sizes), dim=dim))
