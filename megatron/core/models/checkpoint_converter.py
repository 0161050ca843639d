"""``megatron-convert``: convert checkpoints between HuggingFace, megatron-core (Megatron-LM)
and ours, or re-target ours to another default layout
(``python -m megatron.core.models.checkpoint_converter``, ``python tools/checkpoint/convert.py``).

    megatron-convert --loader hf --saver megatron --load-dir HF_DIR --save-dir OUT \\
        [--target-tensor-parallel-size N] [--target-pipeline-parallel-size N] \\
        [--target-generalized-tensor-parallel-size N] [--hybrid-layer-pattern 'M*|-M']
    megatron-convert --loader megatron --saver hf --load-dir OUT --save-dir HF_DIR
    megatron-convert --loader mcore --saver megatron --load-dir MEGATRON_LM_CKPT --save-dir OUT

HF directories are ``save_pretrained`` outputs of LlamaForCausalLM, MixtralForCausalLM,
Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, GPT2LMHeadModel or NemotronHForCausalLM (detected
from config.json); their safetensors are read tensor by
tensor while our checkpoint is written, and no model is built (the peak memory is a few
tensors, not the model). Runs in one CPU process (a gloo world of 1). Our checkpoints are
layout-independent, so the target sizes only become the default layout of the saved model
record; a hybrid
pattern without ``|`` saved for PP > 1 gets its stage boundaries (balanced by layer count, or
``--hybrid-layer-pattern``), and the tool prints where it put them. A model converted from HF
keeps its HF config in the record, so HF -> ours -> HF gives back the same config and
bit-identical tensors; a model trained here is exported as DeepSeek-V3 (multi-latent
attention), Qwen3-MoE or Mixtral (MoE), Llama (RMSNorm GPT), GPT-2 (LayerNorm GPT) or
NemotronH (hybrid) with a config made from its record. The tokenizer (an
HF directory's tokenizer.json, or the one inside our checkpoint) is copied along.
``--loader mcore`` reads megatron-core ``torch_dist`` GPT checkpoints (see ``mcore_checkpoint``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import LazyTensor, iteration_dir, read_latest_iteration
from megatron.core.dist_checkpointing.model_state import describe_tensor, model_checkpoint_tensors, vocab_rows
from megatron.core.errors import MegatronError, MegatronInputError
from megatron.core.models import hf_mapping, mcore_checkpoint
from megatron.core.models.hybrid.hybrid_layer_pattern import segment_for_pipeline
from megatron.core.models.model_record import (
    ModelRecord,
    TokenizerRecord,
    load_model_weights,
    model_from_record,
    read_model_record,
    save_model_checkpoint,
)


class ConversionError(MegatronInputError):
    """A conversion that cannot be done; the message says what was found and what is accepted."""


@dataclass(frozen=True)
class HFFamily:
    """How one HF architecture maps onto our models (functions of ``hf_mapping``)."""

    ours: str  # our model family
    model_type: str  # HF config's model_type
    config_from_hf: Callable  # hf_config -> (TransformerConfig, constructor arguments)
    config_to_hf: Callable  # record -> HF config keyword arguments (models trained here)
    state_dict_from_hf: Callable  # (hf_state_dict, record) -> ours
    state_dict_to_hf: Callable  # (ours, record) -> hf_state_dict
    disk_prefixes: dict | None = None  # safetensors key prefixes transformers writes for module prefixes


HF_FAMILIES = {
    "LlamaForCausalLM": HFFamily(
        "gpt",
        "llama",
        hf_mapping.llama_config_from_hf,
        hf_mapping.llama_config_to_hf,
        lambda sd, r: hf_mapping.llama_state_dict_from_hf(sd, r.config, r.share_embeddings_and_output_weights),
        lambda sd, r: hf_mapping.llama_state_dict_to_hf(sd, r.config, r.vocab_size),
    ),
    "MixtralForCausalLM": HFFamily(
        "gpt",
        "mixtral",
        hf_mapping.mixtral_config_from_hf,
        hf_mapping.mixtral_config_to_hf,
        lambda sd, r: hf_mapping.mixtral_state_dict_from_hf(sd, r.config, r.share_embeddings_and_output_weights),
        lambda sd, r: hf_mapping.mixtral_state_dict_to_hf(sd, r.config, r.vocab_size),
    ),
    "Qwen3MoeForCausalLM": HFFamily(
        "gpt",
        "qwen3_moe",
        hf_mapping.qwen3_moe_config_from_hf,
        hf_mapping.qwen3_moe_config_to_hf,
        lambda sd, r: hf_mapping.qwen3_moe_state_dict_from_hf(sd, r.config, r.share_embeddings_and_output_weights),
        lambda sd, r: hf_mapping.qwen3_moe_state_dict_to_hf(sd, r.config, r.vocab_size),
    ),
    "DeepseekV3ForCausalLM": HFFamily(
        "gpt",
        "deepseek_v3",
        hf_mapping.deepseek_v3_config_from_hf,
        hf_mapping.deepseek_v3_config_to_hf,
        lambda sd, r: hf_mapping.deepseek_v3_state_dict_from_hf(sd, r.config, r.share_embeddings_and_output_weights),
        lambda sd, r: hf_mapping.deepseek_v3_state_dict_to_hf(sd, r.config, r.vocab_size),
    ),
    "GPT2LMHeadModel": HFFamily(
        "gpt",
        "gpt2",
        hf_mapping.gpt2_config_from_hf,
        hf_mapping.gpt2_config_to_hf,
        lambda sd, r: hf_mapping.gpt2_state_dict_from_hf(sd, r.config, r.share_embeddings_and_output_weights),
        lambda sd, r: hf_mapping.gpt2_state_dict_to_hf(sd, r.config, r.vocab_size),
    ),
    "NemotronHForCausalLM": HFFamily(
        "hybrid",
        "nemotron_h",
        hf_mapping.nemotron_h_config_from_hf,
        hf_mapping.nemotron_h_config_to_hf,
        lambda sd, r: hf_mapping.nemotron_h_state_dict_from_hf(
            sd, r.config, r.layer_pattern, r.share_embeddings_and_output_weights
        ),
        lambda sd, r: hf_mapping.nemotron_h_state_dict_to_hf(sd, r.config, r.vocab_size, r.layer_pattern),
        hf_mapping.NEMOTRON_H_DISK_PREFIXES,
    ),
}


@dataclass
class Converted:
    """A model in transit: our full (TP1/PP1) state dict, its record, and its iteration."""

    state_dict: dict
    record: ModelRecord
    iteration: int


def hf_family(architectures) -> tuple[str, HFFamily]:
    """The first supported name of an HF config's ``architectures`` and its mapping."""
    for name in architectures or []:
        if name in HF_FAMILIES:
            return name, HF_FAMILIES[name]
    raise ConversionError(f"HF architectures {architectures} are not supported; supported: {sorted(HF_FAMILIES)}")


def load_hf(load_dir: str) -> Converted:
    """Our record and (lazy) state dict from an HF ``save_pretrained`` directory: its
    safetensors are read tensor by tensor while saving, no HF model is built."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(load_dir)
    architecture, family = hf_family(hf_config.architectures)
    config, kwargs = family.config_from_hf(hf_config)
    has_tokenizer = os.path.isfile(os.path.join(load_dir, "tokenizer.json"))
    record = ModelRecord(
        family=family.ours,
        config=config,
        vocab_size=kwargs.pop("vocab_size"),
        max_sequence_length=kwargs.pop("max_sequence_length"),
        layer_pattern=kwargs.pop("hybrid_layer_pattern", None),
        tokenizer=TokenizerRecord("HuggingFaceTokenizer", os.path.abspath(load_dir)) if has_tokenizer else None,
        hf_architecture=architecture,
        hf_config=hf_config.to_dict(),
        **kwargs,
    )
    hf_tensors = hf_mapping.SafetensorsStateDict(load_dir, family.disk_prefixes)
    return Converted(family.state_dict_from_hf(hf_tensors, record), record, 0)


def load_mcore(load_dir: str) -> Converted:
    """Our state dict and record from a megatron-core ``torch_dist`` checkpoint of a GPT model
    (an ``iter_*`` directory or a root with Megatron-LM's tracker file)."""
    checkpoint_dir = load_dir
    if not os.path.isfile(os.path.join(load_dir, mcore_checkpoint.DCP_INDEX_FILENAME)):
        iteration = read_latest_iteration(load_dir)
        checkpoint_dir = load_dir if iteration is None else iteration_dir(load_dir, iteration)
    checkpoint = mcore_checkpoint.McoreCheckpoint(checkpoint_dir)
    common = checkpoint.common_state()
    if "args" not in common:
        raise ConversionError(
            f"{checkpoint_dir} has no Megatron-LM 'args' in its common state, so the model it holds is unknown"
        )
    config, kwargs = mcore_checkpoint.record_fields_from_args(common["args"])
    search_dirs = list(dict.fromkeys(os.path.abspath(d) for d in (load_dir, checkpoint_dir)))
    tokenizer, note = mcore_checkpoint.tokenizer_from_args(common["args"], search_dirs)
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    record = ModelRecord(family="gpt", config=config, tokenizer=tokenizer, **kwargs)
    shapes = {key: tensor.shape for key, tensor in model_skeleton(record).state_dict().items()}
    state_dict = mcore_checkpoint.state_dict_from_mcore(checkpoint, shapes.keys(), config)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):  # our vocabulary padding may be larger
        if key in state_dict:
            rows = shapes[key][0] - state_dict[key].shape[0]
            state_dict[key] = torch.cat([state_dict[key], state_dict[key].new_zeros(rows, state_dict[key].shape[1])])
    return Converted(state_dict, record, int(common.get("iteration", 0)))


def load_megatron(load_dir: str) -> Converted:
    """Our full state dict from a checkpoint of ours (any saving layout)."""
    record = read_model_record(load_dir)
    model = model_from_record(record, parallel_state.get_process_group_collection())
    load_model_weights(model, load_dir)
    iteration = read_latest_iteration(load_dir)
    return Converted(model.state_dict(), record, iteration or 0)


def model_skeleton(record: ModelRecord) -> torch.nn.Module:
    """The model ``record`` describes with its parameters on the meta device: their names,
    shapes and sharding attributes, and no memory."""
    skeleton = record.replace(config=dataclasses.replace(record.config, perform_initialization=False))
    with torch.device("meta"):
        return model_from_record(skeleton, parallel_state.get_process_group_collection())


def _lazy_tensor(state_dict: Mapping, key: str, dtype: torch.dtype) -> LazyTensor:
    """``state_dict[key]`` cast to ``dtype``, read when the save writes it (an HF mapping reads
    only the HF tensors of the rows written)."""
    if isinstance(state_dict, hf_mapping.MappedStateDict):
        return LazyTensor(
            state_dict.shape(key), dtype, lambda start, stop: state_dict.rows(key, start, stop).to(dtype), name=key
        )
    tensor = state_dict[key]
    return LazyTensor(tuple(tensor.shape), dtype, lambda start, stop: tensor[start:stop].to(dtype), name=key)


def lazy_sharded_state_dict(model: torch.nn.Module, state_dict: Mapping) -> dict:
    """``model.sharded_state_dict()`` with ``state_dict``'s tensors (cast to the parameters'
    dtypes) as the data, each read only when the save writes it: ``model`` may be a
    :func:`model_skeleton`, and a lazy ``state_dict`` (HF safetensors) holds only the tensors
    of the piece being written. Keys and shapes are checked before anything is read."""
    names = set(model.state_dict().keys())  # a tied output layer is a second name of the embedding
    if names != set(state_dict.keys()):
        missing, unexpected = sorted(names - set(state_dict.keys())), sorted(set(state_dict.keys()) - names)
        raise ConversionError(f"state dict does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    specs = model_checkpoint_tensors(model, "", vocab_rows(model))
    for spec in specs:
        shape = hf_mapping.tensor_shape(state_dict, spec.name)
        if shape != tuple(spec.param.shape):
            raise ConversionError(f"{spec.name!r} has shape {shape}, the model needs {tuple(spec.param.shape)}")
    pg = model.pg_collection
    return {
        spec.name: describe_tensor(spec.key, _lazy_tensor(state_dict, spec.name, spec.param.dtype), spec, pg)
        for spec in specs
    }


def save_megatron(converted: Converted, save_dir: str, target_sizes: dict, hybrid_layer_pattern=None) -> str:
    """Save as a checkpoint of ours whose record names ``target_sizes`` as the default layout
    (a hybrid pattern re-segmented for its pipeline size, saying where the boundaries went).
    No model is materialized: the tensors go from the converted state dict to disk one piece
    at a time."""
    record = converted.record.replace(config=dataclasses.replace(converted.record.config, **target_sizes))
    if record.family == "hybrid":
        pattern, placed = segment_for_pipeline(
            record.layer_pattern, target_sizes["pipeline_model_parallel_size"], hybrid_layer_pattern
        )
        if placed is not None:
            print(placed)
        record = record.replace(layer_pattern=pattern)
    elif hybrid_layer_pattern is not None:
        raise ConversionError("--hybrid-layer-pattern is only valid for hybrid models; this is a gpt model")
    pieces = lazy_sharded_state_dict(model_skeleton(record), converted.state_dict)
    return save_model_checkpoint({"model": pieces}, save_dir, converted.iteration, record)


def native_hf_architecture(record: ModelRecord) -> str:
    """The HF architecture a model trained here is exported as: NemotronH for hybrid models;
    DeepSeek-V3 for a GPT with multi-latent attention; for a GPT with MoE layers Qwen3-MoE (with
    per-head query/key norms) or Mixtral; Llama for a GPT with RMSNorm (SwiGLU, RoPE), else GPT-2
    (what the architecture cannot represent is refused by its ``config_to_hf``)."""
    if record.family == "hybrid":
        return "NemotronHForCausalLM"
    if record.config.multi_latent_attention:
        return "DeepseekV3ForCausalLM"
    if record.config.num_moe_experts:
        return "Qwen3MoeForCausalLM" if record.config.qk_layernorm else "MixtralForCausalLM"
    return "LlamaForCausalLM" if record.config.normalization == "RMSNorm" else "GPT2LMHeadModel"


def save_hf(converted: Converted, save_dir: str) -> str:
    """Save as the HF model the checkpoint was converted from (its config is in the record),
    with the checkpoint's HF tokenizer files beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    record = converted.record
    if record.hf_config is None:
        architecture = native_hf_architecture(record)
        family = HF_FAMILIES[architecture]
        hf_config = AutoConfig.for_model(family.model_type, **family.config_to_hf(record))
    else:
        hf_dict = dict(record.hf_config)
        hf_config = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
        family = HF_FAMILIES[record.hf_architecture]
    model = model_from_record(record, parallel_state.get_process_group_collection())
    hf_state_dict = family.state_dict_to_hf(converted.state_dict, record.replace(config=model.config))
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hf_model.load_state_dict(hf_state_dict, strict=True)
    hf_model.save_pretrained(save_dir)
    if record.tokenizer is not None and record.tokenizer.type == "HuggingFaceTokenizer":
        for path in record.tokenizer.files():
            shutil.copyfile(path, os.path.join(save_dir, os.path.basename(path)))
    return save_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-convert", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--loader", choices=["hf", "megatron", "mcore"], required=True)
    parser.add_argument("--saver", choices=["hf", "megatron"], required=True)
    parser.add_argument("--load-dir", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--target-generalized-tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--hybrid-layer-pattern",
        default=None,
        help="hybrid models: the stage boundaries ('|') to save with; the same layers as the model's pattern "
        "(default: the model's, split by layer count when it has no '|' and --target-pipeline-parallel-size > 1)",
    )
    return parser


def convert(argv: list[str] | None = None) -> str:
    """Run a conversion (see the module docstring); returns the directory written."""
    args = build_parser().parse_args(argv)
    for flag in (
        "target_tensor_parallel_size",
        "target_pipeline_parallel_size",
        "target_generalized_tensor_parallel_size",
    ):
        if getattr(args, flag) < 1:
            raise ConversionError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.hybrid_layer_pattern is not None and args.saver != "megatron":
        raise ConversionError("--hybrid-layer-pattern places pipeline stage boundaries; it needs --saver megatron")
    parallel_state.initialize_distributed("gloo")
    if dist.get_world_size() != 1:
        raise ConversionError(f"convert runs in one process; it was started in a world of {dist.get_world_size()}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    converted = {"hf": load_hf, "megatron": load_megatron, "mcore": load_mcore}[args.loader](args.load_dir)
    if args.saver == "hf":
        return save_hf(converted, args.save_dir)
    targets = {
        "tensor_model_parallel_size": args.target_tensor_parallel_size,
        "pipeline_model_parallel_size": args.target_pipeline_parallel_size,
        "generalized_tensor_parallel_size": args.target_generalized_tensor_parallel_size,
    }
    return save_megatron(converted, args.save_dir, targets, args.hybrid_layer_pattern)


def main(argv: list[str] | None = None) -> int:
    joined = dist.is_initialized()
    try:
        path = convert(argv)
    except (ValueError, MegatronError) as error:  # bad input, or a corrupt checkpoint: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if not joined:  # the world convert joined: left before exit, so no gloo thread dies with the interpreter
            parallel_state.destroy_distributed()
    print(f"converted {argv if argv is not None else sys.argv[1:]} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
