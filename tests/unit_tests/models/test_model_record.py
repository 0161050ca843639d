"""The model record: one description that builds what the model constructors build, round
trips through its JSON, carries its tokenizer's files into a checkpoint, and still reads
checkpoints written before version 2 (built here the old way: the sharded save plus the
version 1 ``model_config.json``)."""

import json
import os

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.dist_checkpointing import iteration_dir, save, write_latest_iteration
from megatron.core.inference.checkpoint_loading import load_inference_model
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.models.hybrid import HybridModel, get_hybrid_stack_local_spec
from megatron.core.models.model_record import (
    MODEL_RECORD_FILENAME,
    ModelRecord,
    ModelRecordError,
    TokenizerRecord,
    model_from_record,
    read_model_record,
    save_model_checkpoint,
)
from megatron.core.tokenizers import HuggingFaceTokenizer, TokenizerError
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import train_tiny_tokenizer
from tests.unit_tests.transformer.single_rank import on_single_rank

GPT_CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, init_seed=3)
HYBRID_CONFIG = dict(GPT_CONFIG, mamba_num_heads=4, mamba_head_dim=8, mamba_state_dim=8)


def _gpt_record(**changes) -> ModelRecord:
    fields = dict(
        family="gpt",
        config=TransformerConfig(**GPT_CONFIG, mtp_num_layers=1),
        vocab_size=64,
        max_sequence_length=32,
        position_embedding_type="rope",
        rotary_base=500,
        share_embeddings_and_output_weights=True,
    )
    return ModelRecord(**(fields | changes))


def _hybrid_record(**changes) -> ModelRecord:
    fields = dict(family="hybrid", config=TransformerConfig(**HYBRID_CONFIG), vocab_size=64, max_sequence_length=32)
    return ModelRecord(**(fields | {"layer_pattern": "M*"} | changes))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every tensor equal, vocabulary matrices in their true rows (checkpoints store only
    those; a loaded model's padding rows are zero)."""
    sa, sb = a.state_dict(), b.state_dict()
    rows = a.vocab_size
    return sa.keys() == sb.keys() and all(torch.equal(sa[k][:rows], sb[k][:rows]) for k in sa)


@on_single_rank
def test_model_from_record_builds_what_the_constructors_build(pg):
    """The arguments the pretraining providers passed before the record existed."""
    gpt = _gpt_record()
    layer = get_gpt_layer_local_spec()
    expected = GPTModel(
        gpt.config,
        layer,
        64,
        32,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_base=500,
        rotary_percent=1.0,
        mtp_block_spec=get_gpt_mtp_block_spec(layer),
        pg_collection=pg,
    )
    built = model_from_record(gpt, pg)
    assert type(built) is GPTModel and built.mtp is not None and _same_weights(built, expected)
    hybrid = _hybrid_record()
    expected = HybridModel(
        hybrid.config, get_hybrid_stack_local_spec(), 64, 32, hybrid_layer_pattern="M*", pg_collection=pg
    )
    assert _same_weights(model_from_record(hybrid, pg), expected)
    assert model_from_record(gpt, pg, parallel_output=False).parallel_output is False  # overrides


def test_record_round_trips_through_its_json_as_version_2():
    record = _gpt_record(tokenizer=TokenizerRecord("ByteLevelTokenizer"), hf_architecture="X", hf_config={"a": [1]})
    data = json.loads(json.dumps(record.to_dict()))
    assert data["version"] == 2 and data["spec"] == "gpt_local" and data["layer_pattern"] is None
    assert ModelRecord.from_dict(data) == record
    hybrid = _hybrid_record()
    assert (hybrid.spec, hybrid.position_embedding_type) == ("hybrid_local", "none")  # the family's defaults
    assert ModelRecord.from_dict(hybrid.to_dict()) == hybrid


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: _gpt_record(family="bert"), r"model family 'bert' is unknown; accepted: \['gpt', 'hybrid'\]"),
        (
            lambda: _gpt_record(spec="hybrid_local"),
            r"spec 'hybrid_local' does not build gpt models; accepted: \['gpt_local'\]",
        ),
        (lambda: _gpt_record(layer_pattern="M*"), "layer_pattern is only valid for hybrid models"),
        (lambda: _hybrid_record(layer_pattern=None), "layer_pattern is required for hybrid models"),
        (lambda: _hybrid_record(rope_scaling=True), "rope_scaling is only supported by gpt models"),
        (lambda: _gpt_record(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (lambda: ModelRecord.from_dict({**_gpt_record().to_dict(), "dropout": 0.1}), r"unknown fields \['dropout'\]"),
        (lambda: ModelRecord.from_dict({**_gpt_record().to_dict(), "version": 3}), "version 3 is not supported"),
        (
            lambda: ModelRecord.from_dict({**_version_1(_gpt_record()), "model_kwargs": {"vocab_size": 8, "bias": 1}}),
            r"version 1 model record has unknown fields \['model_kwargs.bias'\]",
        ),
    ],
)
def test_bad_records_are_refused_naming_the_field(make, message):
    with pytest.raises(ModelRecordError, match=message):
        make()


def _version_1(record: ModelRecord, tokenizer_type=None, tokenizer_model=None) -> dict:
    """``record`` in the layout checkpoints had before version 2."""
    kwargs = {
        "vocab_size": record.vocab_size,
        "max_sequence_length": record.max_sequence_length,
        "position_embedding_type": record.position_embedding_type,
        "rotary_percent": record.rotary_percent,
        "rotary_base": record.rotary_base,
        "share_embeddings_and_output_weights": record.share_embeddings_and_output_weights,
    }
    if record.family == "hybrid":
        kwargs["hybrid_layer_pattern"] = record.layer_pattern
    return {
        "version": 1,
        "model_family": record.family,
        "transformer_config": record.config.to_dict(),
        "model_kwargs": kwargs,
        "tokenizer_type": tokenizer_type,
        "tokenizer_model": tokenizer_model,
    }


def _save_the_old_way(model, root: str, old_record: dict) -> None:
    """What checkpoints were before version 2: the weights and the record in the common
    state, the record as model_config.json, then the tracker."""
    path = iteration_dir(root, 3)
    save({"model": model.sharded_state_dict(), "model_config": old_record}, path)
    with open(os.path.join(path, MODEL_RECORD_FILENAME), "w", encoding="utf-8") as f:
        json.dump(old_record, f, indent=1)
    write_latest_iteration(root, 3)


@on_single_rank
def test_checkpoints_written_before_version_2_still_load(pg, tmp_path):
    tokenizer_file = train_tiny_tokenizer(tmp_path / "tok")
    for record in (_gpt_record(vocab_size=320), _hybrid_record(vocab_size=320)):
        root = str(tmp_path / record.family)
        model = model_from_record(record, pg)
        _save_the_old_way(model, root, _version_1(record, "HuggingFaceTokenizer", str(tokenizer_file)))
        read = read_model_record(root)
        assert read == record.replace(tokenizer=TokenizerRecord("HuggingFaceTokenizer", str(tokenizer_file)))
        loaded, tokenizer, _ = load_inference_model(root, pg)
        assert _same_weights(loaded, model)
        assert isinstance(tokenizer, HuggingFaceTokenizer) and tokenizer.tokenizer_file == tokenizer_file
    _save_the_old_way(model, str(tmp_path / "converted"), _version_1(record))  # a converter record without tokenizer
    assert read_model_record(str(tmp_path / "converted")).tokenizer is None


@on_single_rank
def test_save_copies_the_tokenizer_files_into_the_checkpoint_and_names_them_relative_to_it(pg, tmp_path):
    config = {"eos_token": "<|endoftext|>", "chat_template": "{{ messages[0]['content'] }}"}
    train_tiny_tokenizer(tmp_path / "tok", config=config)
    record = _gpt_record(vocab_size=320, tokenizer=TokenizerRecord("HuggingFaceTokenizer", str(tmp_path / "tok")))
    model = model_from_record(record, pg)
    path = save_model_checkpoint({"model": model.sharded_state_dict()}, str(tmp_path / "ckpt"), 7, record)
    assert sorted(os.listdir(os.path.join(path, "tokenizer"))) == ["tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(path, "tokenizer", name), "rb") as copy, open(tmp_path / "tok" / name, "rb") as source:
            assert copy.read() == source.read()
    with open(os.path.join(path, MODEL_RECORD_FILENAME), encoding="utf-8") as f:
        assert json.load(f)["tokenizer"] == {"type": "HuggingFaceTokenizer", "model": "tokenizer"}
    os.rename(tmp_path / "ckpt", tmp_path / "moved")
    read = read_model_record(str(tmp_path / "moved"))
    assert read.tokenizer.model == str(tmp_path / "moved" / "iter_0000007" / "tokenizer")
    assert read.tokenizer.build().chat_template == config["chat_template"]


@on_single_rank
def test_a_missing_tokenizer_fails_the_save_before_anything_is_written(pg, tmp_path):
    record = _gpt_record(tokenizer=TokenizerRecord("HuggingFaceTokenizer", str(tmp_path / "gone")))
    model = model_from_record(record, pg)
    with pytest.raises(TokenizerError, match="tokenizer model .*gone' not found"):
        save_model_checkpoint({"model": model.sharded_state_dict()}, str(tmp_path / "ckpt"), 1, record)
    assert not os.path.exists(tmp_path / "ckpt")
