"""Every file of a checkpoint that does not parse raises CorruptCheckpointError (a runtime
error, not a bad request) naming the file and what was wrong: metadata.json, model_config.json,
the tracker, the shards (missing, truncated, flipped bytes), and the tokenizer's files when they
differ from what was published."""

import json
import os
import re

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.dist_checkpointing import (
    TRACKER_FILENAME,
    CorruptCheckpointError,
    ShardedObject,
    ShardedTensor,
    load,
    load_latest,
    read_latest_iteration,
    save_iteration,
)
from megatron.core.dist_checkpointing.inspect_checkpoint import main as inspect_main
from megatron.core.errors import MegatronRuntimeError
from megatron.core.inference.checkpoint_loading import load_inference_model
from megatron.core.models.model_record import ModelRecord, TokenizerRecord, read_model_record, save_model_checkpoint
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import train_tiny_tokenizer


def _checkpoint(tmp_path) -> tuple[str, str]:
    root = str(tmp_path / "run")
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0)), "o": ShardedObject("o", [1], (1,), (0,))}
    path = save_iteration(state, root, 5, files={"model_config.json": json.dumps({"version": 2}).encode()})
    return root, path


def _request():
    return {"w": ShardedTensor("w", None, torch.float32, (12,), (12,), (0,), None)}


def _rewrite(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_metadata_json_that_is_not_utf8_or_not_json_names_the_file(tmp_path, capsys):
    root, path = _checkpoint(tmp_path)
    metadata = os.path.join(path, "metadata.json")
    text = open(metadata, "rb").read()
    _rewrite(metadata, text[:10] + b"\xff" + text[11:])
    with pytest.raises(CorruptCheckpointError, match=rf"^{metadata} is not valid UTF-8: byte 0xff at offset 10 "):
        load(_request(), path)
    assert inspect_main([path]) == 2  # the inspection tool prints the same one line
    assert capsys.readouterr().err.startswith(f"error: {metadata} is not valid UTF-8: byte 0xff at offset 10")
    _rewrite(metadata, text[: len(text) // 2])
    with pytest.raises(CorruptCheckpointError, match=rf"^{metadata} is malformed: JSONDecodeError: "):
        load(_request(), path)
    _rewrite(metadata, json.dumps({"format": "megatron-dist-checkpoint", "version": 2}).encode())
    with pytest.raises(CorruptCheckpointError, match=rf"^{metadata} is malformed: KeyError: 'tensors'"):
        load(_request(), path)


def test_model_config_json_that_is_truncated_or_not_utf8_names_the_file(tmp_path):
    root, path = _checkpoint(tmp_path)
    record = os.path.join(path, "model_config.json")
    _rewrite(record, b'{"version": 2, "family": "gp')
    with pytest.raises(CorruptCheckpointError, match=rf"^{record} is not valid JSON \(28 bytes\): Unterminated string"):
        read_model_record(root)
    _rewrite(record, b'{"version": 2, "family": "\xc3"}')
    with pytest.raises(CorruptCheckpointError, match=rf"^{record} is not valid UTF-8: byte 0xc3 at offset 26"):
        read_model_record(path)
    _rewrite(record, b"[]")
    with pytest.raises(CorruptCheckpointError, match=rf"^{record} must hold a JSON object, found a list"):
        read_model_record(path)
    _rewrite(record, b'{"version": 2}')
    with pytest.raises(CorruptCheckpointError, match=rf"^{record} is malformed: KeyError: 'config'"):
        read_model_record(path)


@pytest.mark.parametrize("content", [b"", b"five\n", b"\xff\xfe5", b"-5\n"])
def test_a_tracker_that_holds_no_iteration_number_names_the_file(tmp_path, content):
    root, _ = _checkpoint(tmp_path)
    tracker = os.path.join(root, TRACKER_FILENAME)
    _rewrite(tracker, content)
    message = f"{tracker} must hold an iteration number (decimal digits), found {content!r} ({len(content)} bytes)"
    with pytest.raises(CorruptCheckpointError, match=f"^{re.escape(message)}$"):
        read_latest_iteration(root)
    with pytest.raises(CorruptCheckpointError, match=f"^{tracker} must hold an iteration number"):
        load_latest(_request(), root)


def test_damaged_shards_name_the_file_and_item(tmp_path):
    root, path = _checkpoint(tmp_path)
    chunk = json.load(open(os.path.join(path, "metadata.json")))["tensors"]["w"]["chunks"][0]
    shard = os.path.join(path, chunk["file"])
    blob = open(shard, "rb").read()
    _rewrite(shard, blob[: chunk["offset"] + chunk["data_offset"] + 7])
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"^{shard} is truncated: item 'w' needs {chunk['length']} bytes at offset {chunk['offset']}, found "
        rf"{chunk['data_offset'] + 7}$",
    ):
        load(_request(), path)
    os.remove(shard)
    with pytest.raises(CorruptCheckpointError, match=rf"^{shard} is missing from the checkpoint$"):
        load(_request(), path)


def test_a_tokenizer_file_that_differs_from_the_published_one_names_the_file(tmp_path):
    train_tiny_tokenizer(tmp_path / "tok", config={"eos_token": "<|endoftext|>"})
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    tokenizer = TokenizerRecord("HuggingFaceTokenizer", str(tmp_path / "tok"))
    record = ModelRecord("gpt", config, vocab_size=320, max_sequence_length=8, tokenizer=tokenizer)
    root = str(tmp_path / "run")
    path = save_model_checkpoint({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, root, 1, record)
    assert read_model_record(root).vocab_size == 320
    damaged = {
        "tokenizer/tokenizer.json": lambda data: data[: len(data) // 2],  # truncated: fails to parse
        "tokenizer/tokenizer_config.json": lambda data: data + b"}",
    }
    for name, damage in damaged.items():
        file = os.path.join(path, name)
        original = open(file, "rb").read()
        _rewrite(file, damage(original))
        size = os.path.getsize(file)
        message = (
            rf"^{file} is damaged: {size} bytes with XXH3_64 [0-9a-f]{{16}}, the checkpoint recorded {len(original)} "
            r"bytes with XXH3_64 [0-9a-f]{16}$"
        )
        with pytest.raises(CorruptCheckpointError, match=message):
            read_model_record(root)
        with pytest.raises(CorruptCheckpointError, match=message):
            load_inference_model(root, None)  # the serving path reads the record first
        _rewrite(file, original)
    assert read_model_record(path).tokenizer.build().vocab_size == 320


def test_corrupt_checkpoint_errors_are_runtime_faults_not_bad_requests():
    assert issubclass(CorruptCheckpointError, MegatronRuntimeError)
    assert not issubclass(CorruptCheckpointError, ValueError)
