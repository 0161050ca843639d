"""megatron-inspect-ckpt lists a checkpoint; benchmarks/checkpoint_io.py times both paths."""

import math
import os

import torch

from benchmarks.checkpoint_io import gpt_1p3b_shapes, sized_state, summarize, training_state
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


def test_benchmark_times_both_paths_in_alternating_trials_of_identical_round_trips(tmp_path):
    state = sized_state(1, 2, torch.float32, torch.device("cpu"))
    result = run_checkpoint_benchmark(state, 3, torch.device("cpu"), str(tmp_path))
    assert result["bytes"] == 2**20  # run() itself raises if either round trip differs
    assert {op: len(s) for op, s in result["seconds"].items()} == dict.fromkeys(
        ("plain save", "ours save", "plain load", "ours load"), 3
    )
    assert all(s > 0 for values in result["seconds"].values() for s in values)
    assert os.listdir(tmp_path) == []
    summary = summarize("label", result)
    assert set(summary["ratio"]) == {"save", "load"}


def test_benchmark_models_the_full_training_state_of_a_1p3b_gpt():
    shapes = gpt_1p3b_shapes()
    params = sum(math.prod(shape) for shape in shapes.values())
    assert 1.3e9 < params < 1.35e9
    small = gpt_1p3b_shapes(layers=1, hidden=8, ffn=16, vocab=32, seq=4)
    state = training_state(torch.device("cpu"), small)
    assert len(state) == 4 * len(small)  # bf16 weights, fp32 main weights and both Adam moments
    assert {t.dtype for k, t in state.items() if k.startswith("model.")} == {torch.bfloat16}
    assert {t.dtype for k, t in state.items() if k.startswith("optimizer.")} == {torch.float32}


def test_inspect_names_a_directory_that_is_no_checkpoint(tmp_path, capsys):
    assert inspect_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path} is not a complete checkpoint: metadata.json is missing "
        "(only directories published by dist_checkpointing.save can be loaded)\n"
    )
