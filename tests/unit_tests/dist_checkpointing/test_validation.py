"""Planted sharding defects fail validation with messages naming the key, offsets and ranks;
across real gloo ranks a bad state dict fails on every rank before anything is written."""

import os

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingError, ShardedObject, ShardedTensor, save, validate_records
from megatron.core.dist_checkpointing.validation import ShardRecord
from tests.unit_tests.dist_harness import run_distributed


def piece(offset, shape, replica=0, global_shape=(6, 4), dtype=torch.float32, key="w"):
    data = torch.zeros(shape, dtype=dtype)
    return ShardRecord.of(ShardedTensor(key, data, dtype, shape, global_shape, offset, None, replica_id=replica))


def good_layout():
    """Rows 0..3 on rank 0 and rows 3..6 on rank 1, both replicated to ranks 2/3."""
    return {
        0: [piece((0, 0), (3, 4))],
        1: [piece((3, 0), (3, 4))],
        2: [piece((0, 0), (3, 4), replica=1)],
        3: [piece((3, 0), (3, 4), replica=1)],
    }


def failure(records_by_rank) -> str:
    with pytest.raises(CheckpointingError) as err:
        validate_records(records_by_rank)
    return str(err.value)


def test_good_layout_passes():
    validate_records(good_layout())


def test_two_main_replicas_for_one_chunk():
    layout = good_layout()
    layout[2] = [piece((0, 0), (3, 4), replica=0)]
    assert "key 'w': 2 main replicas for the chunk at offset (0, 0) shape (3, 4) on ranks [0, 2]" in failure(layout)


def test_chunk_without_main_replica():
    layout = good_layout()
    layout[1] = [piece((3, 0), (3, 4), replica=2)]
    assert "key 'w': no main replica for the chunk at offset (3, 0) shape (3, 4) held by ranks [1, 3]" in failure(
        layout
    )


def test_gap_names_the_uncovered_rows():
    layout = {0: [piece((0, 0), (3, 4))], 1: [piece((4, 0), (2, 4))]}
    message = failure(layout)
    assert "key 'w': gap: no main chunk covers offset (3, 0) shape (1, 4)" in message
    assert "main chunks cover 20 of 24 elements of global shape (6, 4)" in message


def test_overlap_names_both_chunks_and_ranks():
    layout = {0: [piece((0, 0), (4, 4))], 1: [piece((3, 0), (3, 4))]}
    assert (
        "key 'w': main chunks overlap: offset (0, 0) shape (4, 4) (rank 0) and offset (3, 0) shape (3, 4) (rank 1)"
        in failure(layout)
    )


def test_global_shape_and_dtype_mismatch():
    shape_bad = {0: [piece((0, 0), (3, 4))], 1: [piece((3, 0), (3, 4), global_shape=(7, 4))]}
    assert "key 'w': global shape differs across ranks: (6, 4) on ranks [0]; (7, 4) on ranks [1]" in failure(shape_bad)
    dtype_bad = {0: [piece((0, 0), (3, 4))], 1: [piece((3, 0), (3, 4), dtype=torch.bfloat16)]}
    assert "key 'w': dtype differs across ranks: float32 on ranks [0]; bfloat16 on ranks [1]" in failure(dtype_bad)


def test_objects_need_one_main_per_cell_and_every_cell():
    def obj(offset, replica=0):
        return ShardRecord.of(ShardedObject("rng", 0, (3,), offset, replica_id=replica))

    two_mains = {0: [obj((0,)), obj((1,)), obj((2,))], 1: [obj((1,))]}
    assert "key 'rng': 2 main replicas for the chunk at offset (1,) shape (1,) on ranks [0, 1]" in failure(two_mains)
    missing = {0: [obj((0,))], 1: [obj((2,))]}
    assert "object 'rng': no rank holds the cells at offsets [(1,)] of the grid of shape (3,)" in failure(missing)


def test_key_used_as_tensor_and_object():
    layout = {0: [piece((0, 0), (6, 4))], 1: [ShardRecord.of(ShardedObject("w", 0, (1,), (0,)))]}
    assert "key 'w' is used both as a ShardedTensor (ranks [0]) and as a ShardedObject (ranks [1])" in failure(layout)


def _save_with_two_mains(path):
    rank = torch.distributed.get_rank()
    # Both ranks claim the main copy of the same rows: an overlap-free but duplicated layout.
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2), (0, 0, 2)),
        "v": ShardedTensor.from_rank_offsets("v", torch.ones(2, 2), (0, rank, 2)),
    }
    with pytest.raises(CheckpointingError) as err:
        save(sd, path)
    torch.distributed.barrier()
    return str(err.value), os.listdir(os.path.dirname(path))


def test_invalid_layout_fails_on_every_rank_and_writes_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    messages, listings = zip(*run_distributed(_save_with_two_mains, 2, path), strict=True)
    expected = "key 'w': 2 main replicas for the chunk at offset (0, 0) shape (2, 2) on ranks [0, 1]"
    assert all(expected in m for m in messages)
    assert "key 'w': gap: no main chunk covers offset (2, 0) shape (2, 2)" in messages[0]
    assert listings == ([], [])  # read by the ranks: under torchrun only they share the directory
