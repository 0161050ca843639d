"""megatron-inspect-ckpt lists a checkpoint; benchmarks/checkpoint_io.py times both paths."""

import os

import torch

from benchmarks.checkpoint_io import run as run_checkpoint_benchmark
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, save, write_latest_iteration
from megatron.core.dist_checkpointing.inspect_checkpoint import main as inspect_main


def test_inspect_lists_keys_shapes_dtypes_sizes_of_a_root_at_its_latest_iteration(tmp_path, capsys):
    path = str(tmp_path / "iter_0000003")
    save(
        {
            "w": ShardedTensor.from_rank_offsets("decoder.weight", torch.zeros(64, 32)),
            "b": ShardedTensor.from_rank_offsets("decoder.bias", torch.zeros(16, dtype=torch.bfloat16)),
            "rng": ShardedObject("rng", [1, 2], (1,), (0,)),
            "iteration": 3,
        },
        path,
    )
    write_latest_iteration(str(tmp_path), 3)
    assert inspect_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"checkpoint {path}"
    rows = {line.split()[0]: line.split()[1:] for line in out[2:-1]}
    assert rows["decoder.weight"] == ["64x32", "float32", "8.0", "KiB", "1"]
    assert rows["decoder.bias"] == ["16", "bfloat16", "32", "B", "1"]
    assert rows["rng"][:2] == ["1", "object"]
    assert out[-1] == "2 tensors (8.0 KiB), 1 object grids, common state: yes"


def test_benchmark_times_both_paths_on_identical_round_trips(tmp_path):
    result = run_checkpoint_benchmark(1, 2, torch.float32, str(tmp_path))
    assert result["bytes"] == 2**20  # run() itself raises if either round trip differs
    assert set(result["gbps"]) == {"plain save", "ours save", "plain load", "ours load"}
    assert all(v > 0 for v in result["gbps"].values())
    assert os.listdir(tmp_path) == []


def test_inspect_names_a_directory_that_is_no_checkpoint(tmp_path, capsys):
    assert inspect_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path} is not a complete checkpoint: metadata.json is missing "
        "(only directories published by dist_checkpointing.save can be loaded)\n"
    )
