"""``megatron-convert --loader mcore`` carries the run's Megatron-LM tokenizer arguments: a
torch_dist checkpoint (the fixture's tensors, written again with DCP as megatron-core lays it
out, with tokenizer arguments in its saved ``args``) converts into a checkpoint whose
inference loading builds that tokenizer from files found next to the Megatron-LM checkpoint;
files found nowhere give a one-line note and a checkpoint without a tokenizer."""

import argparse
import os
import shutil
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron.core import parallel_state
from megatron.core.inference.checkpoint_loading import load_inference_model
from megatron.core.models import checkpoint_converter, mcore_checkpoint
from megatron.core.models.model_record import read_model_record
from megatron.core.tokenizers.factory import build_tokenizer
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import train_tiny_gpt2_files

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "data", "mcore_gpt_tp1pp1", "checkpoint")
TEXT = "the quick brown fox jumps over the lazy dog"


def write_mcore_root(root, **arg_changes):
    """A Megatron-LM checkpoint root (tracker + iter_0000007) holding the fixture's tensors and
    common state, its ``args`` changed by ``arg_changes``, written through DCP in megatron-core's
    names (``common_state/shard_0_1``: ``[common]``, which DCP stores with torch.save)."""
    fixture = mcore_checkpoint.McoreCheckpoint(FIXTURE)
    common = fixture.common_state()
    common["args"] = argparse.Namespace(**{**vars(common["args"]), **arg_changes})
    state = {key: fixture.tensor(key) for key in fixture.tensor_keys()} | {"common_state/shard_0_1": [common]}
    iteration_dir = os.path.join(root, "iter_0000007")
    planner = DefaultSavePlanner(flatten_state_dict=False)  # megatron-core keeps the common state one object
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        dcp.save(state, storage_writer=dcp.FileSystemWriter(iteration_dir), planner=planner, no_dist=True)
    shutil.copyfile(os.path.join(FIXTURE, "metadata.json"), os.path.join(iteration_dir, "metadata.json"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")


def _convert_and_tokenize(load_dir, save_dir):
    checkpoint_converter.convert(["--loader", "mcore", "--saver", "megatron", "--load-dir", load_dir,
                                  "--save-dir", save_dir])  # fmt: skip
    _, tokenizer, record = load_inference_model(save_dir, parallel_state.get_process_group_collection())
    return record.tokenizer, tokenizer.tokenize(TEXT) if record.tokenizer is not None else None


def test_the_runs_gpt2_tokenizer_files_next_to_the_checkpoint_travel_into_ours(tmp_path):
    root, out = tmp_path / "megatron_lm", tmp_path / "ours"
    root.mkdir()
    vocab, merges = train_tiny_gpt2_files(root)  # the run had them elsewhere; the user put them beside it
    write_mcore_root(str(root), tokenizer_type="GPT2BPETokenizer", vocab_file="/data/run/gpt2-vocab.json",
                     merge_file="/data/run/gpt2-merges.txt", make_vocab_size_divisible_by=128)  # fmt: skip
    os.rename(vocab, root / "gpt2-vocab.json")
    os.rename(merges, root / "gpt2-merges.txt")
    ((tokenizer_record, ids),) = run_distributed(_convert_and_tokenize, 1, str(root), str(out))
    assert tokenizer_record.type == "GPT2BPETokenizer"
    assert os.path.dirname(tokenizer_record.vocab_file) == str(out / "iter_0000007" / "tokenizer")
    expected = build_tokenizer("GPT2BPETokenizer", vocab_file=root / "gpt2-vocab.json",
                               merge_file=root / "gpt2-merges.txt")  # fmt: skip
    assert ids == expected.tokenize(TEXT) and len(ids) > 3
    shutil.rmtree(root)  # the converted checkpoint needs nothing of the Megatron-LM one
    assert read_model_record(str(out)).tokenizer.build().tokenize(TEXT) == ids


def test_tokenizer_files_found_nowhere_give_a_one_line_note_and_no_tokenizer(tmp_path, capfd):
    root, out = tmp_path / "megatron_lm", tmp_path / "ours"
    root.mkdir()
    write_mcore_root(str(root), tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model="/data/run/spm.model")
    ((tokenizer_record, _),) = run_distributed(_convert_and_tokenize, 1, str(root), str(out))
    assert tokenizer_record is None
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: the checkpoint's tokenizer (GPTSentencePieceTokenizer, --tokenizer-model /data/run/spm.model) is "
        f"found neither where the run had it nor next to the checkpoint in {root}, {root / 'iter_0000007'}; "
        "converted without a tokenizer (put the file(s) there to carry it)"
    ]
