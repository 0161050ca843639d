"""HF import streams: the safetensors of an HF directory are read one key at a time while our
model is filled, so at most one converted tensor (and the HF tensors it is made of) is alive
at once; no HF model is built."""

import gc
import weakref
from collections.abc import Mapping

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron.core import parallel_state
from megatron.core.models import checkpoint_converter, hf_mapping
from megatron.core.models.model_record import model_from_record
from tests.unit_tests.dist_harness import run_distributed


class _CountingTensors(Mapping):
    """An HF state dict that records the most of its tensors alive at once."""

    def __init__(self, inner):
        self.inner, self.alive, self.most_alive, self.reads = inner, weakref.WeakSet(), 0, 0

    def __getitem__(self, key):
        gc.collect()
        tensor = self.inner[key]
        self.reads += 1
        self.alive.add(tensor)
        self.most_alive = max(self.most_alive, len(self.alive))
        return tensor

    def __contains__(self, key):
        return key in self.inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


def _fill_our_model(hf_dir):
    parallel_state.initialize_model_parallel()
    converted = checkpoint_converter.load_hf(hf_dir)
    counting = _CountingTensors(hf_mapping.SafetensorsStateDict(hf_dir))
    family = checkpoint_converter.HF_FAMILIES["LlamaForCausalLM"]
    ours = family.state_dict_from_hf(counting, converted.record)
    assert counting.reads == 0  # mapping checks keys only
    model = model_from_record(converted.record)
    checkpoint_converter._copy_into(model, ours)
    reference = hf_mapping.llama_state_dict_from_hf(LlamaForCausalLM.from_pretrained(hf_dir).state_dict(),
                                                    converted.record.config)  # fmt: skip
    same = all(torch.equal(model.state_dict()[k], reference[k]) for k in reference)
    return counting.reads, counting.most_alive, same


def test_hf_tensors_are_read_one_key_at_a_time(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    hf = LlamaForCausalLM(config)
    hf.save_pretrained(tmp_path)
    ((reads, most_alive, same),) = run_distributed(_fill_our_model, 1, str(tmp_path))
    assert same
    assert reads == len(hf.state_dict())  # every HF tensor read exactly once
    assert most_alive <= 3  # at most the q, k, v of one packed QKV weight at a time
