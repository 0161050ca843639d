"""tools/checkpoint/inspect.py lists a checkpoint; benchmarks/checkpoint_io.py times both paths."""

import importlib.util
import os

import torch

from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, save

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _load_script(*parts):
    spec = importlib.util.spec_from_file_location("_".join(parts).removesuffix(".py"), os.path.join(REPO, *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inspect_lists_keys_shapes_dtypes_sizes(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    save(
        {
            "w": ShardedTensor.from_rank_offsets("decoder.weight", torch.zeros(64, 32)),
            "b": ShardedTensor.from_rank_offsets("decoder.bias", torch.zeros(16, dtype=torch.bfloat16)),
            "rng": ShardedObject("rng", [1, 2], (1,), (0,)),
            "iteration": 3,
        },
        path,
    )
    assert _load_script("tools", "checkpoint", "inspect.py").main([path]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in out[2:-1]}
    assert rows["decoder.weight"] == ["64x32", "float32", "8.0", "KiB", "1"]
    assert rows["decoder.bias"] == ["16", "bfloat16", "32", "B", "1"]
    assert rows["rng"][:2] == ["1", "object"]
    assert out[-1] == "2 tensors (8.0 KiB), 1 object grids, common state: yes"


def test_benchmark_times_both_paths_on_identical_round_trips(tmp_path):
    result = _load_script("benchmarks", "checkpoint_io.py").run(1, 2, torch.float32, str(tmp_path))
    assert result["bytes"] == 2**20  # run() itself raises if either round trip differs
    assert set(result["gbps"]) == {"plain save", "ours save", "plain load", "ours load"}
    assert all(v > 0 for v in result["gbps"].values())
    assert os.listdir(tmp_path) == []
