"""LazyTensor: a save of lazy data reads each piece's rows only when it writes that piece,
writes the bytes a save of the real tensors writes, and refuses what it cannot do lazily."""

import filecmp
import os

import pytest
import torch

from megatron.core.dist_checkpointing import (
    CheckpointingError,
    CheckpointIOError,
    LazyTensor,
    ShardedTensor,
    load,
    packed_column_parallel_factory,
    prepare_save,
    save,
)
from megatron.core.dist_checkpointing.async_save import SnapshotArena

WEIGHT = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)  # packed [a (8 rows); b (4 rows)]
NORM = torch.linspace(0, 1, 5)


def _state(weight, norm):
    return {
        "packed": packed_column_parallel_factory("packed", weight, ["a", "b"], [8, 4], tp_rank=0, tp_size=1),
        "norm": ShardedTensor("norm", norm, torch.float32, (5,), (5,), (0,), None),
    }


class _Rows:
    """``load_rows`` of a lazy tensor over ``tensor`` that logs the row ranges read."""

    def __init__(self, tensor):
        self.tensor, self.reads = tensor, []

    def __call__(self, start, stop):
        self.reads.append((start, stop))
        return self.tensor[start:stop].clone()


def test_a_lazy_save_reads_each_piece_when_written_and_writes_the_same_bytes(tmp_path):
    weight_rows, norm_rows = _Rows(WEIGHT), _Rows(NORM)
    lazy = _state(
        LazyTensor(WEIGHT.shape, torch.float32, weight_rows), LazyTensor(NORM.shape, torch.float32, norm_rows)
    )
    prepared = prepare_save(lazy, str(tmp_path / "lazy"))
    assert weight_rows.reads == [] and norm_rows.reads == []  # describing and preparing read nothing
    prepared.run()
    assert sorted(weight_rows.reads) == [(0, 8), (8, 12)] and norm_rows.reads == [(0, 5)]  # one part at a time
    save(_state(WEIGHT, NORM), str(tmp_path / "eager"))
    compared = filecmp.dircmp(tmp_path / "lazy", tmp_path / "eager", ignore=[".metadata"])  # DCP's: path, save id
    assert not compared.diff_files and not compared.left_only and not compared.right_only
    loaded = load(_state(torch.zeros_like(WEIGHT), torch.zeros_like(NORM)), str(tmp_path / "lazy"))
    assert torch.equal(loaded["packed"], WEIGHT) and torch.equal(loaded["norm"], NORM)
    assert os.path.isfile(tmp_path / "lazy" / "metadata.json")


def test_data_read_with_another_shape_or_dtype_fails_the_write_naming_the_tensor(tmp_path):
    wrong = LazyTensor((5,), torch.float32, lambda start, stop: torch.zeros(stop - start + 1), name="norm")
    state = {"norm": ShardedTensor("norm", wrong, torch.float32, (5,), (5,), (0,), None)}
    with pytest.raises(CheckpointIOError, match=r"CheckpointingError: norm: rows \[0, 5\) were read as \(6,\) torch"):
        save(state, str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt")


def test_what_a_lazy_tensor_cannot_do_is_refused(tmp_path):
    lazy = LazyTensor((4, 2), torch.float32, lambda start, stop: torch.zeros(stop - start, 2), name="w")
    assert lazy[1:3].materialize().shape == (2, 2)
    with pytest.raises(CheckpointingError, match="w: a lazy tensor supports only row slices, got index 1"):
        lazy[1]
    with pytest.raises(CheckpointingError, match=r"w: a lazy tensor of shape \(4, 2\) cannot become \(8,\)"):
        lazy.reshape(8)
    state = {"w": ShardedTensor("w", lazy, torch.float32, (4, 2), (4, 2), (0, 0), None)}
    with pytest.raises(CheckpointingError, match="a background save snapshots its tensors"):
        prepare_save(state, str(tmp_path / "ckpt"), snapshot=SnapshotArena())
