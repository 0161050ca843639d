"""How checkpoint bytes are written and read: one pass with the checksum computed on the way
(never re-reading the file), items that torch's own readers still open, loads straight into
the returned tensors, files published with the shards, end-to-end verification, snapshots,
and format 1 checkpoints written by the previous version."""

import json
import os
import shutil

import pytest
import torch
import xxhash
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron.core.dist_checkpointing import (
    CorruptCheckpointError,
    ShardedObject,
    ShardedTensor,
    load,
    prepare_save,
    read_metadata,
    save,
    verify_checkpoint,
)
from megatron.core.dist_checkpointing.async_save import SnapshotArena
from megatron.core.dist_checkpointing.strategies import stream_io
from tests.unit_tests.dist_checkpointing.checkpoint_contents import everything_in

FORMAT_1 = os.path.join(os.path.dirname(__file__), "data", "format_v1_training")  # written by the previous version


def _state():
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.randn(64, 48)),
        "h": ShardedTensor.from_rank_offsets("h", torch.randn(33).to(torch.bfloat16)),
        "o": ShardedObject("o", {"step": 3, "t": torch.arange(4)}, (1,), (0,)),
        "lr": 0.5,
    }


def test_each_item_holds_its_raw_bytes_at_the_recorded_offset_under_the_recorded_checksum(tmp_path):
    path = str(tmp_path / "ckpt")
    state = _state()
    save(state, path)
    metadata = json.load(open(os.path.join(path, "metadata.json")))
    assert metadata["version"] == 2
    for key in ("w", "h"):
        (chunk,) = metadata["tensors"][key]["chunks"]
        with open(os.path.join(path, chunk["file"]), "rb") as f:
            f.seek(chunk["offset"])
            item = f.read(chunk["length"])
        tensor = state[key].data
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        start = chunk["data_offset"]
        assert item[start : start + len(raw)] == raw
        assert int(chunk["xxh3_64"], 16) == xxhash.xxh3_64_intdigest(item)
    # The items are torch.save archives: torch's own DCP reader opens the checkpoint.
    dcp_to_torch_save(path, str(tmp_path / "plain.pt"))
    plain = torch.load(str(tmp_path / "plain.pt"), weights_only=True)
    assert torch.equal(plain["w"], state["w"].data) and torch.equal(plain["h"], state["h"].data)


def test_save_never_reads_back_what_it_wrote(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the save read a file")

    for name in ("pread", "preadv", "read"):
        monkeypatch.setattr(os, name, refuse)
    real_open = open

    def open_for_writing_only(file, mode="r", *args, **kwargs):
        if "r" in mode and "+" not in mode and str(file).startswith(str(tmp_path)):
            raise AssertionError(f"the save opened {file} for reading")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", open_for_writing_only)
    save(_state(), str(tmp_path / "ckpt"))
    monkeypatch.undo()
    verify_checkpoint(str(tmp_path / "ckpt"))


def test_whole_chunk_loads_land_in_the_returned_tensors_without_unpickling(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    state = _state()
    save(state, path)
    destinations = []
    real_read_into = stream_io.read_into

    def spy(io, fd, offset, dest, hasher):
        destinations.append(dest.data_ptr())
        return real_read_into(io, fd, offset, dest, hasher)

    monkeypatch.setattr("megatron.core.dist_checkpointing.strategies.torch_dcp.read_into", spy)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("format 2 items are never unpickled"))
    loaded = load({k: v for k, v in _state().items() if k != "lr"}, path)
    for key in ("w", "h"):
        assert torch.equal(loaded[key], state[key].data)
        assert loaded[key].data_ptr() in destinations  # read straight into the tensor returned
    assert loaded["o"]["step"] == 3 and torch.equal(loaded["o"]["t"], torch.arange(4)) and loaded["lr"] == 0.5


def test_partial_and_recast_reads_go_through_one_scratch_copy(tmp_path):
    path = str(tmp_path / "ckpt")
    full = torch.randn(64, 48)
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, path)
    box = ShardedTensor("w", None, torch.float32, (64, 16), (64, 48), (0, 16), None)
    as_bf16 = ShardedTensor("w", None, torch.bfloat16, (64, 48), (64, 48), (0, 0), None)
    loaded = load({"box": box, "bf16": as_bf16}, path)
    assert torch.equal(loaded["box"], full[:, 16:32])
    assert torch.equal(loaded["bf16"], full.to(torch.bfloat16))


def test_chunked_pipeline_reads_and_writes_tensors_larger_than_a_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_io, "CHUNK_BYTES", 4096)
    path = str(tmp_path / "ckpt")
    big = torch.randn(3 * 1024 + 17)  # three chunks and a tail
    save({"big": ShardedTensor.from_rank_offsets("big", big.clone())}, path)
    assert torch.equal(load({"big": ShardedTensor.from_rank_offsets("big", torch.empty_like(big))}, path)["big"], big)
    verify_checkpoint(path)


def test_files_are_published_with_the_shards_and_verified_with_them(tmp_path):
    path = str(tmp_path / "ckpt")
    files = {"model_config.json": b'{"version": 2}', "tokenizer/vocab.txt": b"a\nb\n"}
    save(_state(), path, files=files)
    for name, data in files.items():
        assert open(os.path.join(path, name), "rb").read() == data
    assert sorted(read_metadata(path).files) == sorted(files)
    verify_checkpoint(path, required_files=("model_config.json",))
    with open(os.path.join(path, "tokenizer", "vocab.txt"), "ab") as f:
        f.write(b"c\n")
    with pytest.raises(CorruptCheckpointError, match=r"vocab.txt is damaged: 6 bytes with XXH3_64 .*recorded 4 bytes"):
        verify_checkpoint(path)
    with pytest.raises(Exception, match="cannot publish a file named '../x'"):
        save(_state(), str(tmp_path / "other"), files={"../x": b""})


def test_verification_reads_every_item(tmp_path):
    path = str(tmp_path / "ckpt")
    save(_state(), path)
    chunk = json.load(open(os.path.join(path, "metadata.json")))["objects"]["o"]["cells"][0]
    shard = os.path.join(path, chunk["file"])
    blob = bytearray(open(shard, "rb").read())
    blob[chunk["offset"] + chunk["data_offset"]] ^= 0x01
    open(shard, "wb").write(bytes(blob))
    with pytest.raises(CorruptCheckpointError, match=rf"{shard} is corrupted: object 'o' \({chunk['length']} bytes"):
        verify_checkpoint(path)


def test_a_snapshot_is_not_changed_by_later_updates_of_the_state(tmp_path):
    weight = torch.zeros(8, 4)
    arena = SnapshotArena()
    prepared = prepare_save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path / "ckpt"), snapshot=arena)
    weight.add_(1.0)  # the next training step
    prepared.run()
    assert torch.equal(
        load({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path / "ckpt"))["w"], torch.zeros(8, 4)
    )
    again = arena.copy([weight])  # the next save reuses the arena
    assert torch.equal(again[0], weight) and again[0].data_ptr() != weight.data_ptr()


def test_format_1_checkpoints_load_as_torch_reads_them_and_keep_their_crc32_check(tmp_path):
    checkpoint = os.path.join(FORMAT_1, "iter_0000002")
    assert read_metadata(checkpoint).version == 1
    dcp_to_torch_save(checkpoint, str(tmp_path / "plain.pt"))  # torch's own reader: the reference
    plain = torch.load(str(tmp_path / "plain.pt"), weights_only=True)
    ours = everything_in(checkpoint)
    assert len(ours["tensors"]) > 10 and ours["common"]["model_config"]["version"] == 2
    for key, tensor in ours["tensors"].items():
        assert torch.equal(tensor, plain[key]), key
    copy = str(tmp_path / "copy")
    shutil.copytree(checkpoint, copy)
    chunk = json.load(open(os.path.join(copy, "metadata.json")))["tensors"]["embedding.word_embeddings.weight"][
        "chunks"
    ][0]
    shard = os.path.join(copy, chunk["file"])
    blob = bytearray(open(shard, "rb").read())
    blob[chunk["offset"] + chunk["length"] - 100] ^= 0xFF
    open(shard, "wb").write(bytes(blob))
    with pytest.raises(
        CorruptCheckpointError,
        match=r"is corrupted: item 'embedding.word_embeddings.weight' .* has CRC32 [0-9a-f]{8}, the checkpoint "
        r"recorded CRC32",
    ):
        everything_in(copy)


@pytest.mark.gpu(1)
def test_cuda_tensors_go_to_and_from_the_files_through_the_pinned_ring_and_snapshots(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_io, "CHUNK_BYTES", 1 << 16)  # many chunks through the ring of 3 pinned buffers
    tensors = {
        "big": torch.randn(5 * (1 << 14) + 3, device="cuda"),  # five chunks of fp32 and a tail
        "half": torch.randn(300, 77, device="cuda").to(torch.bfloat16),
    }
    path = str(tmp_path / "ckpt")
    save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, path)
    verify_checkpoint(path)
    on_cpu = load({k: ShardedTensor.from_rank_offsets(k, v.cpu()) for k, v in tensors.items()}, path)
    on_gpu = load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in tensors.items()}, path)
    for key, tensor in tensors.items():
        assert torch.equal(on_cpu[key], tensor.cpu())  # the file holds the device tensor's bytes
        assert on_gpu[key].is_cuda and torch.equal(on_gpu[key], tensor)
    weight = torch.zeros(64, 1024, device="cuda")
    arena = SnapshotArena()
    prepared = prepare_save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path / "snap"), snapshot=arena)
    weight.add_(1.0)  # queued on the device right after the snapshot's copies
    prepared.run()
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path / "snap"))["w"]
    assert loaded.is_cuda and torch.equal(loaded, torch.zeros_like(weight))
