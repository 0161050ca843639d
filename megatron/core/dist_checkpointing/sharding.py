"""Section-6 rules for describing parallel-layer weights as checkpoint pieces.

Used by every ``sharded_state_dict()``: where a TP/GTP piece sits in the global tensor (exact
rows, uneven when G does not divide, padding stripped), which replica id a piece gets, and how
a packed column-parallel weight (Mamba in_proj [z, x, B, C, dt], attention [Q, K, V]) is stored
as one global tensor per part so the checkpoint depends on neither TP, GTP nor padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.mapping import ReplicaId, ShardedTensor, ShardedTensorFactory
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel.gtp import shard_offset


def gtp_row_range(global_rows: int, tp_rank: int, tp_size: int, gtp_rank: int, gtp_size: int) -> tuple[int, int]:
    """``(global row offset, rows)`` of the GTP shard of a weight whose dim 0 is split across TP
    (``global_rows / tp_size`` TP-local rows) and then across GTP (``ceil`` rows per peer, the
    last peers short or empty). Pass ``tp_size=1`` for a weight TP-split on another dim."""
    if global_rows % tp_size:
        raise CheckpointingError(f"global rows {global_rows} are not divisible by the tensor-parallel size {tp_size}")
    if not 0 <= tp_rank < tp_size or not 0 <= gtp_rank < gtp_size:
        raise CheckpointingError(
            f"tp rank {tp_rank} must be in [0, {tp_size}) and gtp rank {gtp_rank} in [0, {gtp_size})"
        )
    rows_per_tp = global_rows // tp_size
    start, rows = shard_offset(rows_per_tp, gtp_size, gtp_rank)
    return tp_rank * rows_per_tp + start, rows


def replica_id(pg_collection: ProcessGroupCollection, *, tp_sharded: bool, gtp_sharded: bool) -> ReplicaId:
    """Replica id of a tensor piece: the ranks of every axis that holds identical copies of it.

    GTP-sharded pieces are replicated only over the GTP-excluded ``dp_cp`` group; a piece that
    is whole on every GTP peer includes the GTP rank (else GTP peers would all be main), and one
    that is whole on every TP rank includes the TP rank.
    """
    return (
        0 if tp_sharded else pg_collection.rank("tp"),
        0 if gtp_sharded else pg_collection.rank("gtp"),
        pg_collection.rank("dp_cp"),
    )


def singleton_replica_id(pg_collection: ProcessGroupCollection) -> ReplicaId:
    """Replica id of a singleton object (optimizer param groups, scaler state, ...): tp, pp and
    dp ranks, with cp and gtp ranks appended when those sizes are > 1."""
    rid = [pg_collection.rank("tp"), pg_collection.rank("pp"), pg_collection.rank("dp")]
    for axis in ("cp", "gtp"):
        if pg_collection.size(axis) > 1:
            rid.append(pg_collection.rank(axis))
    return tuple(rid)


def packed_column_parallel_factory(
    key: str,
    data: torch.Tensor,
    part_names: Sequence[str],
    part_sizes: Sequence[int],
    *,
    tp_rank: int,
    tp_size: int,
    gtp_rank: int = 0,
    gtp_size: int = 1,
    replica_id: ReplicaId = (0,),
) -> ShardedTensorFactory:
    """Store a packed column-parallel weight as one global tensor ``f"{key}.{name}"`` per part.

    ``part_sizes`` are the global dim-0 sizes of the parts; each is split evenly across TP and
    the TP-local weight is the concatenation of the parts' TP slices. ``data`` is this rank's
    GTP shard of those TP-local rows with the padding stripped (``gtp_row_range`` rows). Each
    part the shard touches becomes a ShardedTensor at exact part-local rows; loading merges the
    parts back into a tensor of ``data``'s shape, whatever TP/GTP layout saved them.
    """
    if len(part_names) != len(part_sizes) or len(set(part_names)) != len(part_names):
        raise CheckpointingError(
            f"{key}: part_names {list(part_names)} must be distinct, one per part size {list(part_sizes)}"
        )
    for name, size in zip(part_names, part_sizes, strict=True):
        if size % tp_size:
            raise CheckpointingError(
                f"{key}: part {name!r} of {size} rows is not divisible by the tensor-parallel size {tp_size}"
            )
    local_sizes = [size // tp_size for size in part_sizes]
    first, rows = shard_offset(sum(local_sizes), gtp_size, gtp_rank)
    if data.shape[0] != rows:
        raise CheckpointingError(
            f"{key}: the GTP shard has {data.shape[0]} rows but gtp rank {gtp_rank} of {gtp_size} owns {rows} of the "
            f"{sum(local_sizes)} TP-local rows (strip the padding before saving)"
        )
    rest = tuple(data.shape[1:])

    def build(key_, shard, replica):
        pieces, part_start = {}, 0
        for name, size, local in zip(part_names, part_sizes, local_sizes, strict=True):
            lo, hi = max(first, part_start), min(first + rows, part_start + local)
            if lo < hi:
                offset = tp_rank * local + lo - part_start
                pieces[name] = ShardedTensor(
                    f"{key_}.{name}",
                    shard[lo - first : hi - first],
                    shard.dtype,
                    (hi - lo,) + rest,
                    (size,) + rest,
                    (offset,) + (0,) * len(rest),
                    None,
                    replica_id=replica,
                )
            part_start += local
        return pieces

    def merge(loaded):
        parts = [loaded[name] for name in part_names if name in loaded]
        return torch.cat(parts, dim=0) if parts else data.new_empty((0,) + rest)

    return ShardedTensorFactory(key, data, build, merge, replica_id=replica_id)
