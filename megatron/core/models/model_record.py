"""The one description of a model: :class:`ModelRecord`, and the functions that build from it.

A record says everything needed to rebuild a language model with no flags: its family
(``gpt`` or ``hybrid``), the layer spec it is built from (by name, see :data:`SPECS`), its
TransformerConfig (whose parallel sizes are only the default layout), the constructor's
model-shape arguments (vocabulary, sequence length, position embeddings, tied output layer,
hybrid layer pattern) and its tokenizer. It is made once, where the model is first described
(the pretraining flags, an HF config, a checkpoint), and training, checkpoint loading for
inference and serving, and the converter all build through :func:`model_from_record`.

In a checkpoint the record is ``iter_XXXXXXX/model_config.json`` (plain JSON, readable with no
process group), and a tokenizer read from files is copied into ``iter_XXXXXXX/tokenizer/``
and named relative to the iteration directory, so a checkpoint moved elsewhere still opens.
Version 1 records (written before records had a version 2, with ``model_kwargs`` and
``tokenizer_type``/``tokenizer_model`` keys and tokenizer paths as given on the command line)
are still read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from megatron.core.config import TransformerConfig
from megatron.core.dist_checkpointing import (
    AsyncSaver,
    CheckpointingError,
    CorruptCheckpointError,
    adopt_untracked,
    iteration_dir,
    load,
    read_latest_iteration,
    read_metadata,
    save_iteration,
    verify_files,
)
from megatron.core.dist_checkpointing.dist_utils import on_coordinator
from megatron.core.dist_checkpointing.metadata import METADATA_FILENAME, read_json
from megatron.core.dist_checkpointing.model_state import load_model_pieces, stored_pieces
from megatron.core.errors import MegatronError
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.hybrid import HybridModel
from megatron.core.models.hybrid.hybrid_layer_pattern import segment_for_pipeline
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tokenizers.base import MegatronTokenizer
from megatron.core.tokenizers.factory import build_tokenizer
from megatron.core.tokenizers.huggingface import CONFIG_FILE, resolve_tokenizer_file
from megatron.core.transformer.transformer_block import is_first_virtual_stage, is_last_virtual_stage

logger = logging.getLogger(__name__)
MODEL_RECORD_FILENAME = "model_config.json"
TOKENIZER_DIRNAME = "tokenizer"
RECORD_VERSION = 2
FAMILIES = {"gpt": GPTModel, "hybrid": HybridModel}


class ModelRecordError(CheckpointingError):
    """A model record that cannot be read or built; the message names the field at fault."""


def _gpt_local_spec(config: TransformerConfig) -> dict:
    mtp_layer = get_gpt_layer_local_spec(config.num_moe_experts, config.multi_latent_attention)
    return {
        "transformer_layer_spec": get_gpt_decoder_layer_specs(config),
        "mtp_block_spec": get_gpt_mtp_block_spec(mtp_layer) if config.mtp_num_layers else None,
    }


def _hybrid_local_spec(config: TransformerConfig) -> dict:
    return {"hybrid_stack_spec": get_hybrid_stack_local_spec()}


@dataclass(frozen=True)
class SpecBuilder:
    """A named layer spec: the family it builds and the spec arguments of that family's
    constructor for a config (e.g. the MTP block spec when the config has MTP depths)."""

    family: str
    build: Callable[[TransformerConfig], dict]


SPECS = {"gpt_local": SpecBuilder("gpt", _gpt_local_spec), "hybrid_local": SpecBuilder("hybrid", _hybrid_local_spec)}
DEFAULT_SPECS = {"gpt": "gpt_local", "hybrid": "hybrid_local"}
DEFAULT_POSITION_EMBEDDINGS = {"gpt": "learned_absolute", "hybrid": "none"}


@dataclass(frozen=True)
class TokenizerRecord:
    """A tokenizer as ``--tokenizer-type`` and the flags it reads name it: ``model``
    (``--tokenizer-model``: a tokenizer.json or its directory, a SentencePiece .model file),
    ``vocab_file`` / ``merge_file`` (GPT-2 BPE files), ``vocab_size`` (NullTokenizer). None
    where the type reads nothing. In a checkpoint's JSON the paths are relative to the
    iteration directory (see :meth:`stored`)."""

    type: str
    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None

    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("model", "vocab_file", "merge_file")

    def build(self) -> MegatronTokenizer:
        return build_tokenizer(
            self.type, self.model, vocab_file=self.vocab_file, merge_file=self.merge_file, vocab_size=self.vocab_size
        )

    def to_dict(self) -> dict:
        """``type`` and ``model``, and the other fields that are set."""
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if v is not None or k in ("type", "model")}

    def _hf_directory(self) -> bool:
        return self.type == "HuggingFaceTokenizer" and self.model is not None

    def files(self) -> list[str]:
        """The files this tokenizer is read from (none for a tokenizer without files)."""
        if self._hf_directory():
            tokenizer_file = resolve_tokenizer_file(self.model)
            config_file = tokenizer_file.parent / CONFIG_FILE
            return [str(tokenizer_file)] + ([str(config_file)] if config_file.is_file() else [])
        return [getattr(self, name) for name in self.PATH_FIELDS if getattr(self, name) is not None]

    def stored(self, directory: str) -> TokenizerRecord:
        """This record once :meth:`files` are copied (by base name) into ``directory``, a path
        relative to the iteration directory: an HF tokenizer is named by the directory."""
        if self._hf_directory():
            return dataclasses.replace(self, model=directory)
        names = [os.path.basename(path) for path in self.files()]
        if len(set(names)) != len(names):
            raise ModelRecordError(
                f"tokenizer files {self.files()} share a file name; a checkpoint stores them side by side"
            )
        return dataclasses.replace(
            self,
            **{
                name: os.path.join(directory, os.path.basename(getattr(self, name)))
                for name in self.PATH_FIELDS
                if getattr(self, name) is not None
            },
        )

    def located(self, directory: str) -> TokenizerRecord:
        """This record with its relative paths taken relative to ``directory``."""
        return dataclasses.replace(
            self,
            **{
                name: os.path.join(os.path.abspath(directory), getattr(self, name))
                for name in self.PATH_FIELDS
                if getattr(self, name) is not None
            },
        )


@dataclass(frozen=True)
class ModelRecord:
    """What rebuilds a model with no flags (see the module docstring).

    ``position_embedding_type`` and ``spec`` default to the family's; ``layer_pattern`` is the
    hybrid layer pattern (hybrid models only); ``hf_architecture`` / ``hf_config`` are kept by
    the converter so a model converted from HuggingFace converts back to the same HF config.
    """

    family: str
    config: TransformerConfig
    vocab_size: int
    max_sequence_length: int
    spec: str | None = None
    layer_pattern: str | None = None
    position_embedding_type: str | None = None
    share_embeddings_and_output_weights: bool = False
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    tokenizer: TokenizerRecord | None = None
    hf_architecture: str | None = None
    hf_config: dict | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ModelRecordError(f"model family {self.family!r} is unknown; accepted: {sorted(FAMILIES)}")
        if self.spec is None:
            object.__setattr__(self, "spec", DEFAULT_SPECS[self.family])
        if self.position_embedding_type is None:
            object.__setattr__(self, "position_embedding_type", DEFAULT_POSITION_EMBEDDINGS[self.family])
        builder = SPECS.get(self.spec)
        if builder is None or builder.family != self.family:
            accepted = sorted(name for name, spec in SPECS.items() if spec.family == self.family)
            raise ModelRecordError(f"spec {self.spec!r} does not build {self.family} models; accepted: {accepted}")
        if (self.family == "hybrid") != (self.layer_pattern is not None):
            raise ModelRecordError(
                f"layer_pattern is {'required' if self.family == 'hybrid' else 'only valid'} for hybrid models "
                f"(family {self.family!r}, layer_pattern {self.layer_pattern!r})"
            )
        if self.family == "hybrid" and self.rope_scaling:
            raise ModelRecordError("rope_scaling is only supported by gpt models")
        for name in ("vocab_size", "max_sequence_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelRecordError(f"{name} must be a positive integer, got {value!r}")

    def config_for(self, pg_collection: ProcessGroupCollection) -> TransformerConfig:
        """The config with the parallel sizes of ``pg_collection`` (the record's are only defaults)."""
        tp = pg_collection.size("tp")
        return dataclasses.replace(
            self.config,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pg_collection.size("pp"),
            generalized_tensor_parallel_size=pg_collection.size("gtp"),
            context_parallel_size=pg_collection.size("cp") if pg_collection.has("cp") else 1,
            sequence_parallel=self.config.sequence_parallel and tp > 1,
            virtual_pipeline_model_parallel_size=None,  # a run's choices, like the sizes above
            num_layers_in_first_pipeline_stage=None,
            num_layers_in_last_pipeline_stage=None,
        )

    def replace(self, **changes) -> ModelRecord:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The JSON object of this record (the current :data:`RECORD_VERSION`)."""
        data = {"version": RECORD_VERSION}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "config":
                value = value.to_dict()
            elif field.name == "tokenizer" and value is not None:
                value = value.to_dict()
            data[field.name] = value
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ModelRecord:
        """Inverse of :meth:`to_dict`; reads version 1 records too. Unknown keys are an error."""
        version = data.get("version")
        if version == 1:
            return _from_version_1(data)
        if version != RECORD_VERSION:
            raise ModelRecordError(f"model record version {version!r} is not supported; readable: 1, {RECORD_VERSION}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - {"version"})
        if unknown:
            raise ModelRecordError(f"model record has unknown fields {unknown}; known: {sorted(fields)}")
        values = {k: v for k, v in data.items() if k != "version"}
        values["config"] = TransformerConfig.from_dict(values["config"])
        if values.get("tokenizer") is not None:
            values["tokenizer"] = TokenizerRecord(**values["tokenizer"])
        return cls(**values)


# Version 1: {"model_family", "transformer_config", "model_kwargs": constructor arguments,
# "tokenizer_type", "tokenizer_model", and from the converter "hf_config", "hf_architecture"}.
_VERSION_1_KEYS = {"version", "model_family", "transformer_config", "model_kwargs", "tokenizer_type", "tokenizer_model"}
_VERSION_1_KWARGS = {
    "vocab_size",
    "max_sequence_length",
    "position_embedding_type",
    "share_embeddings_and_output_weights",
    "rotary_percent",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
    "hybrid_layer_pattern",
}


def _from_version_1(data: dict) -> ModelRecord:
    unknown = sorted(set(data) - _VERSION_1_KEYS - {"hf_config", "hf_architecture"})
    unknown += sorted(f"model_kwargs.{k}" for k in set(data["model_kwargs"]) - _VERSION_1_KWARGS)
    if unknown:
        raise ModelRecordError(f"version 1 model record has unknown fields {unknown}")
    kwargs = dict(data["model_kwargs"])
    tokenizer = None
    if data.get("tokenizer_type"):
        tokenizer = TokenizerRecord(data["tokenizer_type"], data.get("tokenizer_model"))
    return ModelRecord(
        family=data["model_family"],
        config=TransformerConfig.from_dict(data["transformer_config"]),
        layer_pattern=kwargs.pop("hybrid_layer_pattern", None),
        tokenizer=tokenizer,
        hf_architecture=data.get("hf_architecture"),
        hf_config=data.get("hf_config"),
        **kwargs,
    )


def model_from_record(record: ModelRecord, pg_collection: ProcessGroupCollection | None = None, **overrides):
    """This pipeline stage's model as ``record`` describes it, for the layout of
    ``pg_collection`` (None: the global one), built from the spec the record names. A hybrid
    pattern without ``|`` is split over PP > 1 stages by layer count (logged on rank 0).
    ``overrides`` replace constructor arguments (e.g. ``parallel_output=False``)."""
    return _model_chunk(record, resolve_pg_collection(pg_collection), {}, None, overrides)


def model_chunks_from_record(
    record: ModelRecord,
    pg_collection: ProcessGroupCollection | None = None,
    virtual_pipeline_model_parallel_size: int | None = None,
    stage_ends: tuple[int | None, int | None] = (None, None),
    **overrides,
) -> list[torch.nn.Module]:
    """This pipeline rank's model chunks: one (:func:`model_from_record`) without virtual
    stages, else ``virtual_pipeline_model_parallel_size`` of them, chunk v holding virtual stage
    ``v * PP + pp_rank`` (the first stage builds the embedding, the last the output layer and MTP).
    ``stage_ends``: the layers of the first and of the last pipeline stage for an uneven split
    (None: even), a run's choice like the virtual stages (see ``stage_layer_counts``)."""
    pg = resolve_pg_collection(pg_collection)
    vp_size = virtual_pipeline_model_parallel_size
    layout = {
        "virtual_pipeline_model_parallel_size": vp_size,
        "num_layers_in_first_pipeline_stage": stage_ends[0],
        "num_layers_in_last_pipeline_stage": stage_ends[1],
    }
    if vp_size is None:
        return [_model_chunk(record, pg, layout, None, overrides)]
    return [_model_chunk(record, pg, layout, vp_stage, overrides) for vp_stage in range(vp_size)]


def _model_chunk(record: ModelRecord, pg: ProcessGroupCollection, layout: dict, vp_stage: int | None, overrides: dict):
    config = dataclasses.replace(record.config_for(pg), **layout)
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    kwargs = {
        "vocab_size": record.vocab_size,
        "max_sequence_length": record.max_sequence_length,
        "pre_process": is_first_virtual_stage(config, pp_rank, pp_size, vp_stage),
        "post_process": is_last_virtual_stage(config, pp_rank, pp_size, vp_stage),
        "share_embeddings_and_output_weights": record.share_embeddings_and_output_weights,
        "position_embedding_type": record.position_embedding_type,
        "rotary_percent": record.rotary_percent,
        "rotary_base": record.rotary_base,
        "pg_collection": pg,
        "vp_stage": vp_stage,
        **SPECS[record.spec].build(config),
    }
    if record.family == "gpt":
        kwargs.update(rope_scaling=record.rope_scaling, rope_scaling_factor=record.rope_scaling_factor)
    else:
        pattern, placed = segment_for_pipeline(record.layer_pattern, pg.size("pp"))
        if placed is not None and dist.is_initialized() and dist.get_rank() == 0:
            logger.warning(placed)
        kwargs["hybrid_layer_pattern"] = pattern
    return FAMILIES[record.family](config, **(kwargs | overrides))


# ------------------------------------------------------------------ records in checkpoints


def resolve_checkpoint_dir(path: str) -> str:
    """``path`` itself when it is an ``iter_*`` directory, else the iteration its tracker names."""
    if os.path.isfile(os.path.join(path, MODEL_RECORD_FILENAME)):
        return path
    iteration = read_latest_iteration(path)
    if iteration is None:
        raise CheckpointingError(
            f"{path} is neither a checkpoint iteration directory (no {MODEL_RECORD_FILENAME}) nor a checkpoint root "
            "(no latest_checkpointed_iteration.txt)"
        )
    return iteration_dir(path, iteration)


def read_model_record(path: str) -> ModelRecord:
    """The record of the checkpoint at ``path`` (root or iteration directory); a plain JSON
    read. Its tokenizer path is resolved to where the checkpoint is now. A record that does not
    parse, or tokenizer files that differ from those published with the checkpoint (which the
    tokenizer library would fail on with errors of its own), raise CorruptCheckpointError naming
    the file."""
    checkpoint_dir = resolve_checkpoint_dir(path)
    record_path = os.path.join(checkpoint_dir, MODEL_RECORD_FILENAME)
    data = read_json(record_path)
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{record_path} must hold a JSON object, found a {type(data).__name__}")
    try:
        record = ModelRecord.from_dict(data)
    except MegatronError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptCheckpointError(f"{record_path} is malformed: {type(err).__name__}: {err}") from err
    if data["version"] > 1 and record.tokenizer is not None:
        record = record.replace(tokenizer=record.tokenizer.located(checkpoint_dir))
    _verify_tokenizer_files(checkpoint_dir)
    return record


def _verify_tokenizer_files(checkpoint_dir: str) -> None:
    """Check the tokenizer's files against the lengths and checksums the metadata recorded when
    they were published with the checkpoint (older checkpoints do not list them; a directory
    without metadata is refused by the weight load). The record itself is only parsed: it is
    plain JSON meant to be read, and its parse errors already name what is wrong."""
    if not os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILENAME)):
        return
    metadata = read_metadata(checkpoint_dir)
    verify_files(checkpoint_dir, metadata, [n for n in metadata.files if n.startswith(f"{TOKENIZER_DIRNAME}/")])


def _stored_record(record: ModelRecord) -> ModelRecord:
    """``record`` as a checkpoint stores it: its tokenizer's files in ``tokenizer/``."""
    if record.tokenizer is None or not record.tokenizer.files():
        return record
    return record.replace(tokenizer=record.tokenizer.stored(TOKENIZER_DIRNAME))


def save_model_checkpoint(
    sharded_state_dict: dict,
    root: str,
    iteration: int,
    record: ModelRecord,
    *,
    async_saver: AsyncSaver | None = None,
    on_saved: Callable[[], None] | None = None,
    retain_interval: int | None = None,
) -> str:
    """Collectively save ``sharded_state_dict`` as iteration ``iteration`` of ``root`` with the
    model ``record``: the record in the common state and as ``model_config.json``, the
    tokenizer's files in ``tokenizer/``, all published at once with the shards; then move the
    tracker (so it only ever names directories that are complete). An earlier save of this
    iteration interrupted before the tracker moved is adopted or replaced (see
    :func:`megatron.core.dist_checkpointing.save_iteration`, which also explains
    ``async_saver``, ``on_saved`` and ``retain_interval``). Returns the iteration directory."""
    tokenizer_files = record.tokenizer.files() if record.tokenizer is not None else []  # every rank: fail alike
    stored = _stored_record(record)
    files = {MODEL_RECORD_FILENAME: json.dumps(stored.to_dict(), indent=1).encode()}
    for source in tokenizer_files:
        with open(source, "rb") as f:
            files[f"{TOKENIZER_DIRNAME}/{os.path.basename(source)}"] = f.read()
    return save_iteration(
        {**sharded_state_dict, "model_config": stored.to_dict()},
        root,
        iteration,
        files=files,
        required_files=(MODEL_RECORD_FILENAME,),
        async_saver=async_saver,
        on_saved=on_saved,
        retain_interval=retain_interval,
    )


def adopt_untracked_checkpoints(root: str) -> int | None:
    """Before saving into ``root``: verify every iteration newer than its tracker and move the
    tracker to the newest complete one (see :func:`megatron.core.dist_checkpointing.adopt_untracked`;
    a complete one holds ``model_config.json``). Collective over the world; returns the
    tracker's iteration."""
    return on_coordinator(lambda: adopt_untracked(root, required_files=(MODEL_RECORD_FILENAME,)), None)


def load_model_weights(model: torch.nn.Module, path: str) -> str:
    """Load only the weights of the checkpoint at ``path`` (root or iteration directory) into
    ``model`` (any layout; a DistributedDataParallel wrapper is looked through); returns the
    directory read."""
    checkpoint_dir = resolve_checkpoint_dir(path)
    model = getattr(model, "module", model)
    loaded = load({"model": stored_pieces(model, model.sharded_state_dict(), checkpoint_dir)}, checkpoint_dir)
    load_model_pieces(model, loaded["model"])
    return checkpoint_dir
