"""HF import streams: the converter builds no model (its skeleton's parameters are on the meta
device) and writes our checkpoint piece by piece, each HF tensor read from the safetensors
only when the piece made of it is written and freed before the next is read. The bytes it
writes are those of saving a materialized model."""

import dataclasses
import filecmp
import os
import weakref
from collections.abc import Mapping

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron.core import parallel_state
from megatron.core.models import checkpoint_converter, hf_mapping
from megatron.core.models.model_record import (
    load_model_weights,
    model_from_record,
    read_model_record,
    save_model_checkpoint,
)
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.tools.test_convert import HF_MODELS, _hf_model

TARGETS = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "generalized_tensor_parallel_size": 1}


class _CountingTensors(Mapping):
    """An HF state dict that records how often its tensors are read and the most alive at once
    (freed by reference counting: no ``gc.collect``, so a tensor kept in a cycle counts as alive)."""

    def __init__(self, inner):
        self.inner, self.alive, self.most_alive, self.reads = inner, weakref.WeakSet(), 0, {}

    def __getitem__(self, key):
        tensor = self.inner[key]
        self.reads[key] = self.reads.get(key, 0) + 1
        self.alive.add(tensor)
        self.most_alive = max(self.most_alive, len(self.alive))
        return tensor

    def __contains__(self, key):
        return key in self.inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def shape(self, key):
        return self.inner.shape(key)


def _convert_counting(hf_dir, out_dir):
    parallel_state.initialize_model_parallel()
    built = []

    def recording_model_from_record(*args, **kwargs):
        model = model_from_record(*args, **kwargs)
        built.append({p.device.type for p in model.parameters()})
        return model

    checkpoint_converter.model_from_record = recording_model_from_record  # this rank's process only
    converted = checkpoint_converter.load_hf(hf_dir)
    counting = _CountingTensors(hf_mapping.SafetensorsStateDict(hf_dir))
    family = checkpoint_converter.HF_FAMILIES["LlamaForCausalLM"]
    converted.state_dict = family.state_dict_from_hf(counting, converted.record)
    assert not counting.reads  # mapping checks keys and shapes only
    checkpoint_converter.save_megatron(converted, out_dir, TARGETS)
    return counting.reads, counting.most_alive, built


def _loaded_state(path):
    parallel_state.initialize_model_parallel()
    model = model_from_record(read_model_record(path))
    load_model_weights(model, path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_import_builds_no_model_and_reads_each_tensor_once_holding_one_at_a_time(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    hf = LlamaForCausalLM(config)
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "ours")
    hf.save_pretrained(hf_dir)
    ((reads, most_alive, built),) = run_distributed(_convert_counting, 1, hf_dir, out)
    assert built and all(devices == {"meta"} for devices in built)  # no model with memory was built
    assert reads == dict.fromkeys(hf.state_dict(), 1)  # every HF tensor read exactly once (q, k, v separately)
    assert most_alive == 1  # a tensor is freed once written, before the next is read
    (loaded,) = run_distributed(_loaded_state, 1, out)
    expected = hf_mapping.llama_state_dict_from_hf(hf.state_dict(), checkpoint_converter.load_hf(hf_dir).record.config)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def _save_both_ways(hf_dir, streamed_dir, materialized_dir):
    """Our converter's save, and the reference: a real model filled with the converted tensors
    and saved through its own sharded state dict."""
    parallel_state.initialize_model_parallel()
    converted = checkpoint_converter.load_hf(hf_dir)
    checkpoint_converter.save_megatron(converted, streamed_dir, TARGETS)
    record = converted.record.replace(config=dataclasses.replace(converted.record.config, **TARGETS))
    model = model_from_record(record)
    model.load_state_dict(dict(converted.state_dict.items()), strict=True)
    save_model_checkpoint({"model": model.sharded_state_dict()}, materialized_dir, 0, record)


def _differing_files(left, right):
    """Files that differ, DCP's pickled ``.metadata`` aside (it holds the path and a random save id)."""
    compared = filecmp.dircmp(left, right, ignore=[".metadata"])
    differing = compared.left_only + compared.right_only + compared.diff_files + compared.funny_files
    for sub in compared.common_dirs:
        differing += _differing_files(os.path.join(left, sub), os.path.join(right, sub))
    return differing


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_streamed_save_writes_the_bytes_of_a_materialized_model(tmp_path, name):
    hf_dir = str(tmp_path / "hf")
    _hf_model(name).save_pretrained(hf_dir)
    streamed, materialized = tmp_path / "streamed", tmp_path / "materialized"
    run_distributed(_save_both_ways, 1, hf_dir, str(streamed), str(materialized))
    assert os.listdir(streamed / "iter_0000000") and not _differing_files(streamed, materialized)
