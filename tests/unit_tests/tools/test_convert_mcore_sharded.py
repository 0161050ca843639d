"""``megatron-convert --loader mcore`` reads global tensors stored as several chunks: the
fixture's tensors are written again by 2 gloo ranks through torch.distributed.checkpoint, each
saving its TP-style slice (rows of column-parallel weights, columns of row-parallel ones) under
the same names, as a TP2 megatron-core run stores them; read, it holds what the
one-chunk fixture holds (the same global tensors and arguments), and it converts."""

import os
import subprocess
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from megatron.core.models import mcore_checkpoint
from tests.unit_tests.dist_harness import run_distributed

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "data", "mcore_gpt_tp1pp1", "checkpoint")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")  # split on their input (last) dim
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")


def _save_tp2_slices(checkpoint_dir):
    fixture = mcore_checkpoint.McoreCheckpoint(FIXTURE)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, size = dist.get_rank(), dist.get_world_size()
    state = {"common_state/shard_0_1": [fixture.common_state()]}
    for key in fixture.tensor_keys():
        tensor = fixture.tensor(key)
        dim = (
            tensor.dim() - 1
            if key.endswith(ROW_PARALLEL)
            else tensor.dim() - 2
            if key.endswith(COLUMN_PARALLEL)
            else None
        )
        if dim is None:
            state[key] = tensor  # replicated: DCP writes it once
        else:
            local = tensor.chunk(size, dim=dim)[rank].contiguous()
            state[key] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    dcp.save(
        state, storage_writer=dcp.FileSystemWriter(checkpoint_dir), planner=DefaultSavePlanner(flatten_state_dict=False)
    )
    return sorted(os.listdir(checkpoint_dir))


def _convert(load_dir, save_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-m", "megatron.core.models.checkpoint_converter", "--loader", "mcore", "--saver",
         "megatron", "--load-dir", load_dir, "--save-dir", save_dir],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_chunks_written_by_two_ranks_read_as_the_one_chunk_fixture_and_convert(tmp_path):
    sharded = tmp_path / "tp2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = run_distributed(_save_tp2_slices, 2, str(sharded))
    assert files[0] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks wrote their slices
    fixture, tp2 = mcore_checkpoint.McoreCheckpoint(FIXTURE), mcore_checkpoint.McoreCheckpoint(str(sharded))
    assert len(tp2.index.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"].chunks) == 2
    assert sorted(tp2.tensor_keys()) == sorted(fixture.tensor_keys())
    assert all(torch.equal(tp2.tensor(key), fixture.tensor(key)) for key in fixture.tensor_keys())
    assert vars(tp2.common_state()["args"]) == vars(fixture.common_state()["args"])
    _convert(str(sharded), str(tmp_path / "ours"))
    assert os.listdir(tmp_path / "ours" / "iter_0000007")
