"""Shared helpers of the tensor-parallel tests: collections for a layout, and an independent
re-implementation of how a full tensor is cut into one rank's TP/GTP piece."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  assert_close imports it lazily (~1 s); pay once, before forking ranks

from megatron.core.config import TransformerConfig
from megatron.core.process_groups import ProcessGroupCollection, RankLayout


def collection(tp: int = 1, gtp: int = 1, pp: int = 1) -> ProcessGroupCollection:
    """The world's collection for a layout with the given sizes (dp fills the rest)."""
    return ProcessGroupCollection.from_layout(RankLayout.for_world(dist.get_world_size(), tp=tp, gtp=gtp, pp=pp))


def tp_config(**overrides) -> TransformerConfig:
    """A tiny TransformerConfig (only its parallel and init fields matter to these layers)."""
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4)
    return TransformerConfig(**(base | overrides))


def data_seed(tp_size: int) -> int:
    """Seed of this rank's data: shared by a TP group, different between GTP peers and replicas
    (default order: tp is the fastest axis)."""
    me = dist.get_rank()
    return me - me % tp_size


def gtp_peer_seeds(pg: ProcessGroupCollection, tp_size: int) -> list[int]:
    """Data seeds of every peer in this rank's gtp group (this rank included)."""
    ranks = dist.get_process_group_ranks(pg.gtp) if pg.has("gtp") else [dist.get_rank()]
    return [r - r % tp_size for r in ranks]


def expected_piece(full: torch.Tensor, dim: int, parts, tp_rank: int, tp: int, gtp_rank: int, gtp: int) -> torch.Tensor:
    """Cut ``full`` the documented way: every packed part split over TP along ``dim``, this rank's
    slices concatenated; then dim 0 padded to a multiple of ``gtp`` and cut in ``gtp`` rows blocks."""
    if dim >= 0:
        pieces = full.split(list(parts), dim=dim) if parts else [full]
        full = torch.cat([p.chunk(tp, dim=dim)[tp_rank] for p in pieces], dim=dim)
    if gtp == 1:
        return full
    rows = full.shape[0]
    per = math.ceil(rows / gtp)
    padded = torch.zeros((per * gtp,) + tuple(full.shape[1:]), dtype=full.dtype)
    padded[:rows] = full
    return padded[gtp_rank * per : (gtp_rank + 1) * per]
