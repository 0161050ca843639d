"""ShardedTensor / ShardedObject descriptions, the GTP row rule, packed-part factories and the
pickle-free object codec, each checked against hand-computed expectations."""

import numpy as np
import pytest
import torch

from megatron.core.dist_checkpointing import (
    CheckpointingError,
    CorruptCheckpointError,
    ShardedObject,
    ShardedTensor,
    gtp_row_range,
    object_codec,
    packed_column_parallel_factory,
)
from megatron.core.dist_checkpointing.mapping import apply_factories


def test_from_rank_offsets_places_the_piece_in_the_global_grid():
    data = torch.zeros(3, 4)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 1, 5), (1, 1, 2), replica_id=(0, 1), prepend_axis_num=1)
    assert sh.local_shape == (1, 3, 4)
    assert sh.global_shape == (5, 6, 4)
    assert sh.global_offset == (1, 3, 0)
    assert sh.axis_fragmentations == (5, 2, 1)
    assert sh.replica_id == (0, 1) and not sh.is_main


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(local_shape=(3, 4), global_shape=(5, 4), global_offset=(3, 0)),
            "axis 0 spans [3, 6) which is outside the global size 5",
        ),
        (dict(local_shape=(3, 4), global_shape=(5, 4), global_offset=(0,)), "must have the same number of axes"),
        (
            dict(local_shape=(2, 4), global_shape=(5, 4), global_offset=(0, 0)),
            "data has shape (3, 4) but local_shape (2, 4)",
        ),
        (
            dict(local_shape=(3, 4), global_shape=(5, 4), global_offset=(0, 0), dtype=torch.float16),
            "data has dtype torch.float32 but dtype torch.float16",
        ),
        (
            dict(local_shape=(3, 4), global_shape=(5, 4), global_offset=(0, 0), replica_id=(0, -1)),
            "replica_id must be a non-negative",
        ),
    ],
)
def test_inconsistent_sharded_tensor_is_rejected(kwargs, message):
    fields = dict(dtype=torch.float32, axis_fragmentations=None) | kwargs
    with pytest.raises(CheckpointingError) as err:
        ShardedTensor("w", torch.zeros(3, 4), **fields)
    assert message in str(err.value)


def test_sharded_object_must_be_a_grid_cell():
    assert ShardedObject("rng", 1, (2, 4), (1, 3)).unique_key == "rng/shard_1.3_2.4"
    with pytest.raises(CheckpointingError, match=r"global_offset \(2, 0\) is not a cell of a grid of shape \(2, 4\)"):
        ShardedObject("rng", 1, (2, 4), (2, 0))


def reference_rows(global_rows, tp, tp_rank, gtp, gtp_rank):
    """Independent rule: split into TP blocks, pad each block to a multiple of G, take this
    peer's padded rows and keep only the real ones (as a list of global row numbers)."""
    block = list(range(tp_rank * global_rows // tp, (tp_rank + 1) * global_rows // tp))
    per_peer = -(-len(block) // gtp)
    padded = block + [None] * (per_peer * gtp - len(block))
    return [r for r in padded[gtp_rank * per_peer : (gtp_rank + 1) * per_peer] if r is not None]


@pytest.mark.parametrize("global_rows, tp, gtp", [(10, 2, 2), (10, 2, 4), (12, 3, 5), (7, 1, 3), (8, 2, 1)])
def test_gtp_row_range_gives_exact_uneven_rows(global_rows, tp, gtp):
    covered = []
    for tp_rank in range(tp):
        for gtp_rank in range(gtp):
            offset, rows = gtp_row_range(global_rows, tp_rank, tp, gtp_rank, gtp)
            expected = reference_rows(global_rows, tp, tp_rank, gtp, gtp_rank)
            assert list(range(offset, offset + rows)) == expected
            covered += expected
    assert sorted(covered) == list(range(global_rows))


def test_gtp_row_range_rejects_rows_not_divisible_by_tp():
    with pytest.raises(CheckpointingError, match="global rows 7 are not divisible by the tensor-parallel size 2"):
        gtp_row_range(7, 0, 2, 0, 1)


def test_packed_factory_stores_one_global_tensor_per_part():
    # Parts z:4, x:6, d:2 rows, TP=2 -> TP-local rows [z 2 | x 3 | d 1] = 6; G=4 -> 2,2,2,0 rows.
    names, sizes, tp, gtp = list("zxd"), [4, 6, 2], 2, 4
    full = {
        n: torch.arange(s * 3, dtype=torch.float32).reshape(s, 3) + 100 * i
        for i, (n, s) in enumerate(zip(names, sizes, strict=True))
    }
    rows_seen = {n: [] for n in names}
    for tp_rank in range(tp):
        tp_local = torch.cat(
            [full[n][tp_rank * s // tp : (tp_rank + 1) * s // tp] for n, s in zip(names, sizes, strict=True)]
        )
        for gtp_rank in range(gtp):
            shard = tp_local[2 * gtp_rank : 2 * gtp_rank + 2]
            factory = packed_column_parallel_factory(
                "in_proj", shard, names, sizes, tp_rank=tp_rank, tp_size=tp, gtp_rank=gtp_rank, gtp_size=gtp
            )
            built, factories = apply_factories({"f": factory})
            for name, sh in built["f"].items():
                assert sh.key == f"in_proj.{name}" and sh.global_shape == (sizes[names.index(name)], 3)
                (row,) = sh.global_offset[:1]
                torch.testing.assert_close(sh.data, full[name][row : row + sh.local_shape[0]])
                rows_seen[name] += range(row, row + sh.local_shape[0])
            merged = factories[0][1].merge_fn({n: sh.data for n, sh in built["f"].items()})
            torch.testing.assert_close(merged, shard)
    assert {n: sorted(r) for n, r in rows_seen.items()} == {
        n: list(range(s)) for n, s in zip(names, sizes, strict=True)
    }
    # Spot check by hand: tp 1, gtp 1 holds TP-local rows 2..3 = global x rows 3 and 4.
    shard = torch.cat([full["z"][2:], full["x"][3:], full["d"][1:]])[2:4]
    built, _ = apply_factories(
        {"f": packed_column_parallel_factory("p", shard, names, sizes, tp_rank=1, tp_size=2, gtp_rank=1, gtp_size=4)}
    )
    assert list(built["f"]) == ["x"] and built["f"]["x"].global_offset == (3, 0)


def test_packed_factory_rejects_padded_shard():
    with pytest.raises(
        CheckpointingError, match="the GTP shard has 2 rows but gtp rank 1 of 2 owns 1 of the 3 TP-local rows"
    ):
        packed_column_parallel_factory(
            "p", torch.zeros(2, 3), ["a", "b"], [4, 2], tp_rank=0, tp_size=2, gtp_rank=1, gtp_size=2
        )


def test_object_codec_round_trips_exactly_without_pickle():
    value = {
        "step": 3,
        1: (1.5, None, True, "s"),
        "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "e": torch.empty(0, 4),
        "np": np.arange(5, dtype=np.uint32),
        "b": b"\x00\x01",
        "l": [float("inf"), [torch.tensor(True)]],
    }
    blob = object_codec.encode(value)
    assert b"pickle" not in blob and blob[:4] == b"MCKO"
    back = object_codec.decode(blob)
    assert back.keys() == value.keys() and back[1] == value[1] and back["b"] == value["b"]
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], value["t"])
    assert back["e"].shape == (0, 4)
    assert back["np"].dtype == np.uint32 and np.array_equal(back["np"], value["np"])
    assert back["l"][0] == float("inf") and torch.equal(back["l"][1][0], torch.tensor(True))


def test_object_codec_rejects_unsafe_values():
    with pytest.raises(CheckpointingError, match=r"cannot serialize object\['f'\]: type function is not accepted"):
        object_codec.encode({"f": lambda: 0})
    with pytest.raises(CheckpointingError, match="numpy arrays of object dtype are not accepted"):
        object_codec.encode(np.array([object()]))
    with pytest.raises(CorruptCheckpointError, match="bad magic"):
        object_codec.decode(b"\x80\x04pickle")
