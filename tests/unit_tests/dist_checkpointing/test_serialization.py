"""Save on one layout, load on another, across real gloo ranks; checked against the full
tensors built in the test (the independent reference), and against torch's own DCP tooling."""

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron.core.dist_checkpointing import (
    TRACKER_FILENAME,
    CheckpointingError,
    CheckpointIOError,
    CorruptCheckpointError,
    ShardedObject,
    ShardedTensor,
    gtp_row_range,
    iteration_dir,
    load,
    load_latest,
    packed_column_parallel_factory,
    read_latest_iteration,
    save,
    save_iteration,
)
from megatron.core.dist_checkpointing.strategies import torch_dcp
from tests.unit_tests.dist_harness import run_distributed

COLUMN = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)  # TP on dim 0, GTP on TP-local rows
ROW = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8) * -1  # TP on dim 1, GTP on dim 0
NORM = torch.linspace(0, 1, 6)
PARTS = {"z": torch.arange(8 * 3.0).reshape(8, 3), "x": 100 + torch.arange(4 * 3.0).reshape(4, 3)}


def _tp_gtp_state(tp, tp_rank, gtp, gtp_rank):
    """A rank's pieces: column weight [10, 6] (5 TP-local rows, uneven over G), row weight,
    a norm replicated over TP and GTP, a packed [z, x] weight, and a per-TP-rank object."""
    col_off, col_rows = gtp_row_range(10, tp_rank, tp, gtp_rank, gtp)
    row_off, row_rows = gtp_row_range(4, 0, 1, gtp_rank, gtp)
    cols = 8 // tp
    tp_local_packed = torch.cat([p[tp_rank * len(p) // tp : (tp_rank + 1) * len(p) // tp] for p in PARTS.values()])
    packed_off, packed_rows = gtp_row_range(len(tp_local_packed), 0, 1, gtp_rank, gtp)
    return {
        "col": ShardedTensor(
            "col",
            COLUMN[col_off : col_off + col_rows].clone(),
            torch.float32,
            (col_rows, 6),
            (10, 6),
            (col_off, 0),
            None,
        ),
        "row": ShardedTensor(
            "row",
            ROW[row_off : row_off + row_rows, tp_rank * cols : (tp_rank + 1) * cols].clone(),
            torch.float32,
            (row_rows, cols),
            (4, 8),
            (row_off, tp_rank * cols),
            None,
        ),
        "norm": ShardedTensor.from_rank_offsets("norm", NORM.clone(), replica_id=(tp_rank, gtp_rank)),
        "packed": packed_column_parallel_factory(
            "packed",
            tp_local_packed[packed_off : packed_off + packed_rows].clone(),
            ["z", "x"],
            [8, 4],
            tp_rank=tp_rank,
            tp_size=tp,
            gtp_rank=gtp_rank,
            gtp_size=gtp,
            replica_id=(0,),
        ),
        "rng": ShardedObject(
            "rng", {"tp": tp_rank, "state": torch.full((2,), float(tp_rank))}, (tp,), (tp_rank,), replica_id=gtp_rank
        ),
        "iteration": 7,
        "args": {"lr": 0.5, "layers": [1, 2]},
    }


def _packed_request(tp_rank, tp):
    rows = sum(len(p) for p in PARTS.values()) // tp
    return packed_column_parallel_factory(
        "packed", torch.zeros(rows, 3), ["z", "x"], [8, 4], tp_rank=tp_rank, tp_size=tp
    )


def _save_tp2_gtp2(path):
    rank = dist.get_rank()
    save(_tp_gtp_state(2, rank % 2, 2, rank // 2), path)


def _load_tp2_on_dim1(path):
    tp_rank = dist.get_rank()
    request = {
        "col": ShardedTensor("col", None, torch.float32, (10, 3), (10, 6), (0, 3 * tp_rank), None),
        "packed": _packed_request(tp_rank, 2),
        "rng": ShardedObject("rng", None, (2,), (tp_rank,)),
        "iteration": 0,
    }
    out = load(request, path)
    return out["col"], out["packed"], out["rng"], out["iteration"], out["args"]


def _load_whole(path):
    request = {
        "col": ShardedTensor("col", None, torch.float32, (10, 6), (10, 6), (0, 0), None),
        "row": ShardedTensor("row", None, torch.float32, (4, 8), (4, 8), (0, 0), None),
        "norm": ShardedTensor("norm", None, torch.float32, (6,), (6,), (0,), None),
        "packed": _packed_request(0, 1),
    }
    return load(request, path)


def test_tp2_gtp2_uneven_save_loads_as_tp2_on_dim1_and_whole(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_tp2_gtp2, 4, path)
    on_two = run_distributed(_load_tp2_on_dim1, 2, path)
    for tp_rank, (col, packed, rng, iteration, args) in enumerate(on_two):
        torch.testing.assert_close(col, COLUMN[:, 3 * tp_rank : 3 * tp_rank + 3], rtol=0, atol=0)
        expected_packed = torch.cat(
            [PARTS["z"][4 * tp_rank : 4 * tp_rank + 4], PARTS["x"][2 * tp_rank : 2 * tp_rank + 2]]
        )
        torch.testing.assert_close(packed, expected_packed, rtol=0, atol=0)
        assert rng["tp"] == tp_rank and torch.equal(rng["state"], torch.full((2,), float(tp_rank)))
        assert iteration == 7 and args == {"lr": 0.5, "layers": [1, 2]}
    (whole,) = run_distributed(_load_whole, 1, path)
    for key, expected in (("col", COLUMN), ("row", ROW), ("norm", NORM)):
        torch.testing.assert_close(whole[key], expected, rtol=0, atol=0)
    torch.testing.assert_close(whole["packed"], torch.cat(list(PARTS.values())), rtol=0, atol=0)

    # Every main piece was written exactly once, and torch's own DCP tooling opens the checkpoint.
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert len(meta["tensors"]["col"]["chunks"]) == 4 and len(meta["tensors"]["norm"]["chunks"]) == 1
    assert sorted((c["global_offset"], c["local_shape"]) for c in meta["tensors"]["col"]["chunks"]) == [
        ([0, 0], [3, 6]),
        ([3, 0], [2, 6]),
        ([5, 0], [3, 6]),
        ([8, 0], [2, 6]),
    ]
    dcp_to_torch_save(path, str(tmp_path / "plain.pt"))
    plain = torch.load(str(tmp_path / "plain.pt"), weights_only=True)
    torch.testing.assert_close(plain["col"], COLUMN, rtol=0, atol=0)
    torch.testing.assert_close(plain["row"], ROW, rtol=0, atol=0)
    torch.testing.assert_close(plain["packed.x"], PARTS["x"], rtol=0, atol=0)


def test_allow_shape_mismatch_reads_the_overlap(tmp_path):
    path = str(tmp_path / "ckpt")
    save({"emb": ShardedTensor.from_rank_offsets("emb", COLUMN.clone())}, path)
    padded = ShardedTensor("emb", None, torch.float32, (12, 6), (12, 6), (0, 0), None)
    with pytest.raises(
        CheckpointingError, match=r"the checkpoint holds global shape \(10, 6\) but global shape \(12, 6\)"
    ):
        load({"emb": padded}, path)
    padded.allow_shape_mismatch = True
    out = load({"emb": padded}, path)["emb"]
    torch.testing.assert_close(out[:10], COLUMN, rtol=0, atol=0)
    assert torch.count_nonzero(out[10:]) == 0


def _fail_after_writing_on_rank1(root):
    rank = dist.get_rank()

    def state(value):
        return {
            "w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), value + rank), (0, rank, 2)),
            "step": value,
        }  # noqa: E731

    save_iteration(state(1.0), root, 1)
    original = torch_dcp.HashingFileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        if rank == 1:
            raise RuntimeError("disk full (simulated)")
        return future

    torch_dcp.HashingFileSystemWriter.write_data = write_then_die
    try:
        with pytest.raises(CheckpointIOError) as err:  # a runtime fault, not a bad request
            save_iteration(state(2.0), root, 2)
    finally:
        torch_dcp.HashingFileSystemWriter.write_data = original
    dist.barrier()
    survived = load_latest({"w": ShardedTensor("w", None, torch.float32, (4, 3), (4, 3), (0, 0), None)}, root)
    staging_left = os.path.isdir(iteration_dir(root, 2) + ".incomplete")
    dist.barrier()
    save_iteration(state(3.0), root, 2)  # a later save replaces the stale staging directory
    dist.barrier()
    # Read back here: under torchrun only the ranks share ``root`` (each test process has its own tmp_path).
    return str(err.value), survived, staging_left, sorted(os.listdir(root)), read_latest_iteration(root)


def test_save_killed_midway_leaves_previous_checkpoint_and_tracker(tmp_path):
    results = run_distributed(_fail_after_writing_on_rank1, 2, str(tmp_path))
    for message, (state, iteration), staging_left, listing, latest in results:
        assert "rank 1: RuntimeError: disk full (simulated)" in message
        assert iteration == 1 and state["step"] == 1.0
        torch.testing.assert_close(state["w"], torch.tensor([[1.0] * 3] * 2 + [[2.0] * 3] * 2))
        assert staging_left
        assert listing == sorted([TRACKER_FILENAME, "iter_0000001", "iter_0000002"]) and latest == 2


def test_corrupted_or_truncated_shard_fails_with_a_clear_error(tmp_path):
    path = str(tmp_path / "ckpt")
    save({"w": ShardedTensor.from_rank_offsets("w", COLUMN.clone()), "o": ShardedObject("o", [1, 2], (1,), (0,))}, path)
    request = {"w": ShardedTensor("w", None, torch.float32, (10, 6), (10, 6), (0, 0), None)}
    chunk = json.load(open(os.path.join(path, "metadata.json")))["tensors"]["w"]["chunks"][0]
    shard = os.path.join(path, chunk["file"])
    blob = bytearray(open(shard, "rb").read())
    blob[chunk["offset"] + chunk["length"] - 9] ^= 0xFF
    open(shard, "wb").write(bytes(blob))
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"{shard} is corrupted: item 'w' \({chunk['length']} bytes at offset {chunk['offset']}\) has XXH3_64 "
        r"[0-9a-f]{16}, the checkpoint recorded XXH3_64 [0-9a-f]{16}$",
    ):
        load(request, path)
    open(shard, "wb").write(bytes(blob[: chunk["offset"] + 10]))
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"{shard} is truncated: item 'w' needs {chunk['length']} bytes at offset {chunk['offset']}, found 10",
    ):
        load(request, path)


def test_load_errors_name_what_is_missing(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointingError, match="is not a complete checkpoint: metadata.json is missing"):
        load({}, path)
    save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "o": ShardedObject("o", np.ones(2), (1,), (0,))},
        path,
    )
    with pytest.raises(
        CheckpointingError, match=r"tensor 'v' is not in the checkpoint; it holds 1 tensors, e.g. \['w'\]"
    ):
        load({"v": ShardedTensor.from_rank_offsets("v", torch.ones(2))}, path)
    with pytest.raises(
        CheckpointingError,
        match=r"object 'o': cell \(1,\) of a grid of shape \(2,\) was requested, "
        r"the checkpoint holds a grid of shape \(1,\)",
    ):
        load({"o": ShardedObject("o", None, (2,), (1,))}, path)
    with pytest.raises(CheckpointingError, match="already exists; a published checkpoint is never overwritten"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, path)
