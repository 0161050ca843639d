"""The Mamba mixer under context parallelism: sequence shards become head shards before the
conv, and back after the gated norm.

The scan is sequential along the sequence, so instead of passing states between CP ranks the
mixer trades dimensions: after ``in_proj`` each CP rank holds its two load-balanced chunks of
the sequence for all of its TP rank's heads; an all-to-all over the ``cp`` group gives it the
whole sequence, in natural order, for ``1/cp`` of those heads (and of the B/C groups). The conv,
the scan and the gated norm then run unchanged, as they would at TP x CP tensor parallelism
(heads split over TP x CP), on whole sequences, so the conv needs no halo. A second all-to-all
returns the norm output to sequence shards for ``out_proj``. The all-to-alls use
``all_to_all_single`` (gloo has no list form) and are their own backward.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.sharding import (
    ContextParallelConfigError,
    shard_sequence,
    unshard_sequence,
)

if TYPE_CHECKING:
    from megatron.core.ssm.backends import MixerWeights
    from megatron.core.ssm.mamba_mixer import MambaDims


class _AllToAll(torch.autograd.Function):
    """Block ``j`` of dim 0 goes to rank ``j``; block ``i`` of the output came from rank ``i``.
    The transpose of that exchange is the same exchange, so backward is one more all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class MambaContextParallel:
    """Layout switches and per-rank parameter slices of one mixer under CP (see the module doc).

    ``dims`` are the mixer's TP-local sizes; :attr:`head_dims` are the sizes each CP rank's
    heads have (TP x CP shards)."""

    def __init__(self, dims: MambaDims, group: dist.ProcessGroup):
        self.group = group
        self.cp_rank, self.cp_size = dist.get_rank(group), dist.get_world_size(group)
        shards = dims.tp_size * self.cp_size
        if dims.nheads % shards or dims.ngroups % shards:
            raise ContextParallelConfigError(
                f"mamba_num_heads ({dims.nheads}) and mamba_num_groups ({dims.ngroups}) must be divisible by "
                f"tensor_model_parallel_size x context_parallel_size ({dims.tp_size} x {self.cp_size}): "
                "the Mamba scan runs on heads split over TP x CP"
            )
        self.dims = dims
        self.head_dims = dataclasses.replace(dims, tp_size=shards)

    def _per_rank_channels(self, t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Split the packed channel parts (TP-local ``sizes``) of ``t [..., sum(sizes)]`` into the
        packed parts of each CP rank's heads: one tensor per CP rank."""
        parts = [part.chunk(self.cp_size, dim=-1) for part in t.split(sizes, dim=-1)]
        return [torch.cat([part[rank] for part in parts], dim=-1) for rank in range(self.cp_size)]

    def sequence_to_heads(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """``in_proj`` output ``[s/cp, b, z|x|B|C|dt (TP-local)]`` (this rank's chunks) to
        ``[s, b, z|x|B|C|dt of this CP rank's heads]`` (the whole sequence, natural order)."""
        sizes = [self.dims.local(size) for size in self.dims.in_proj_sizes]
        outgoing = torch.stack(self._per_rank_channels(zxbcdt, sizes))  # [cp (to), s/cp, b, c/cp]
        incoming = _AllToAll.apply(outgoing, self.group)  # [cp (from), s/cp, b, c/cp]
        return unshard_sequence(list(incoming.unbind(0)), seq_dim=0)

    def heads_to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """Norm output ``[s, b, d_inner of this CP rank's heads]`` to ``[s/cp, b, d_inner (TP-local)]``
        of this rank's chunks."""
        outgoing = torch.stack([shard_sequence(y, rank, self.cp_size, seq_dim=0) for rank in range(self.cp_size)])
        incoming = _AllToAll.apply(outgoing, self.group)  # [cp (heads of), s/cp, b, d/cp]
        return incoming.permute(1, 2, 0, 3).flatten(2)

    def weights(self, weights: MixerWeights) -> MixerWeights:
        """The slices of the TP-local mixer parameters that this CP rank's heads use."""
        rank = self.cp_rank

        def heads(t):
            return t.chunk(self.cp_size, dim=0)[rank]

        conv_sizes = [self.dims.local(size) for size in self.dims.conv_sizes]
        conv_weight = self._per_rank_channels(weights.conv_weight.transpose(0, -1), conv_sizes)[rank]
        conv_bias = self._per_rank_channels(weights.conv_bias, conv_sizes)[rank]
        return type(weights)(
            conv_weight.transpose(0, -1).contiguous(),
            conv_bias,
            heads(weights.A_log),
            heads(weights.D),
            heads(weights.dt_bias),
            heads(weights.norm_weight),
        )
