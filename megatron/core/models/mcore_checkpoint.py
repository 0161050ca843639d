"""Reading megatron-core ``torch_dist`` checkpoints (Megatron-LM's default format) into our GPT.

A torch_dist directory is a torch.distributed.checkpoint (DCP) store: a ``.metadata`` index and
``__R_N.distcp`` files of global tensors in chunks. It is read here without the code that wrote
it and without unpickling anything arbitrary: the index is read by an unpickler that accepts
only DCP's metadata classes, every stored chunk (a ``torch.save`` of a tensor) and the common
state (Megatron-LM's ``args``, iteration, checkpoint version) load with ``weights_only=True``,
the latter with ``argparse.Namespace`` as the only extra allowed global.

The run's tokenizer arguments (``--tokenizer-type`` and its ``--vocab-file`` / ``--merge-file`` /
``--tokenizer-model`` / ``--vocab-size``) are carried too, with the files looked up where the run
had them and, by name, next to the checkpoint.

The model is described by the run's Megatron-LM arguments (``args`` in the common state) and
its weights keyed as megatron-core's GPTModel names them (layers stacked on a leading dim;
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` for the TE spec's fused
norms, which megatron-core also uses for its local spec, or ``input_layernorm`` /
``pre_mlp_layernorm``). megatron-core packs QKV per query group ([q of group 0, k0, v0, q of
group 1, ...]); ours is [Q; K; V], so that is the one reordering. Because DCP stores global
tensors, any TP/PP layout of the writing run reads the same.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle

import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.errors import MegatronInputError
from megatron.core.models.model_record import TokenizerRecord
from megatron.core.tokenizers.factory import TOKENIZER_TYPES, tokenizer_inputs

DCP_INDEX_FILENAME = ".metadata"
COMMON_STATE_PREFIX = "common_state"
_ALLOWED_INDEX_CLASSES = {
    ("pathlib", "PosixPath"),  # DCP's FileSystemWriter records the checkpoint path it was given as one
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *(
        ("torch.distributed.checkpoint.planner", name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    ),
}


class McoreCheckpointError(MegatronInputError):
    """A megatron-core checkpoint that cannot be read or represented by our models."""


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index and nothing else (no callables beyond its classes)."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED_INDEX_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise McoreCheckpointError(
            f"the checkpoint index names {module}.{name}, which is not a torch.distributed.checkpoint "
            "metadata class; refusing to unpickle it"
        )


class McoreCheckpoint:
    """One torch_dist checkpoint directory: its index, tensors and common state."""

    def __init__(self, checkpoint_dir: str):
        self.checkpoint_dir = checkpoint_dir
        index_path = os.path.join(checkpoint_dir, DCP_INDEX_FILENAME)
        if not os.path.isfile(index_path):
            raise McoreCheckpointError(
                f"{checkpoint_dir} is not a megatron-core torch_dist checkpoint (no {DCP_INDEX_FILENAME}); "
                "give an iter_XXXXXXX directory or a root with latest_checkpointed_iteration.txt"
            )
        with open(index_path, "rb") as f:
            self.index = _IndexUnpickler(f).load()
        self._chunks: dict[str, list] = {}
        for item_index, storage in self.index.storage_data.items():
            self._chunks.setdefault(item_index.fqn, []).append((item_index, storage))

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.index.state_dict_metadata.items() if hasattr(v, "size")]

    def _read(self, storage) -> bytes:
        if getattr(storage, "transform_descriptors", None):
            raise McoreCheckpointError(f"stored item transforms {storage.transform_descriptors} are not supported")
        with open(os.path.join(self.checkpoint_dir, storage.relative_path), "rb") as f:
            f.seek(storage.offset)
            return f.read(storage.length)

    def tensor(self, key: str) -> torch.Tensor:
        """The global tensor ``key``, assembled from its stored chunks."""
        meta = self.index.state_dict_metadata.get(key)
        if meta is None or not hasattr(meta, "size"):
            raise McoreCheckpointError(f"the checkpoint has no tensor {key!r}; it has {sorted(self.tensor_keys())}")
        out = torch.empty(meta.size, dtype=meta.properties.dtype)
        for item_index, storage in self._chunks[key]:
            chunk = torch.load(io.BytesIO(self._read(storage)), weights_only=True)
            region = tuple(slice(o, o + n) for o, n in zip(item_index.offset, chunk.shape, strict=True))
            out[region] = chunk
        return out

    def common_state(self) -> dict:
        """The checkpoint's common (non-sharded) state, e.g. ``args`` and ``iteration``."""
        keys = [k for k in self._chunks if k.split("/")[0] == COMMON_STATE_PREFIX]
        if not keys:
            return {}
        (_, storage), *_ = self._chunks[keys[0]]
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(io.BytesIO(self._read(storage)), weights_only=True)
        # megatron-core stores it as a one-element list (an object sharded over one writer)
        return state[0] if isinstance(state, list) and len(state) == 1 else state


def _arg(args, name, default=None):
    return getattr(args, name, default)


def record_fields_from_args(args: argparse.Namespace) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and GPTModel arguments equivalent to a Megatron-LM run's ``args``."""
    unsupported = [
        (_arg(args, "num_experts"), "MoE (--num-experts)"),
        (_arg(args, "qk_layernorm"), "--qk-layernorm"),
        (_arg(args, "apply_layernorm_1p"), "--apply-layernorm-1p"),
        (_arg(args, "multi_latent_attention"), "--multi-latent-attention"),
        (_arg(args, "mtp_num_layers"), "--mtp-num-layers"),
        (
            _arg(args, "position_embedding_type", "learned_absolute") not in ("rope", "learned_absolute"),
            f"position embeddings {_arg(args, 'position_embedding_type')!r} (supported: rope, learned_absolute)",
        ),
        (_arg(args, "use_rope_scaling"), "--use-rope-scaling"),
        (
            _arg(args, "normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"),
            f"--normalization {_arg(args, 'normalization')!r}",
        ),
    ]
    problems = [what for bad, what in unsupported if bad]
    if problems:
        raise McoreCheckpointError("megatron-core checkpoint settings not supported: " + "; ".join(problems))
    swiglu = bool(_arg(args, "swiglu", False))
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if _arg(args, "group_query_attention") else None,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=_arg(args, "kv_channels"),
        normalization=_arg(args, "normalization", "LayerNorm"),
        layernorm_epsilon=_arg(args, "norm_epsilon", 1e-5),
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=bool(_arg(args, "add_bias_linear", True)),
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", False)),
        rotary_interleaved=bool(_arg(args, "rotary_interleaved", False)),
        hidden_dropout=_arg(args, "hidden_dropout", 0.1),
        attention_dropout=_arg(args, "attention_dropout", 0.1),
        init_method_std=_arg(args, "init_method_std", 0.02),
    )
    kwargs = {
        "vocab_size": args.padded_vocab_size,
        "max_sequence_length": _arg(args, "max_position_embeddings") or args.seq_length,
        "position_embedding_type": _arg(args, "position_embedding_type", "learned_absolute"),
        "rotary_percent": float(_arg(args, "rotary_percent", 1.0)),
        "rotary_base": _arg(args, "rotary_base", 10000),
        "share_embeddings_and_output_weights": not _arg(args, "untie_embeddings_and_output_weights", False),
    }
    return config, kwargs


# Megatron-LM's argument -> TokenizerRecord field, for the inputs a tokenizer type reads
_TOKENIZER_FIELDS = {"tokenizer_model": "model", "vocab_file": "vocab_file", "merge_file": "merge_file"}


def tokenizer_from_args(args: argparse.Namespace, search_dirs: list[str]) -> tuple[TokenizerRecord | None, str | None]:
    """The tokenizer a Megatron-LM run's ``args`` name (``--tokenizer-type`` and the files or
    ``--vocab-size`` it reads), each file found where the run had it or, by its name, in one of
    ``search_dirs`` (next to the checkpoint). Returns (record, None), or (None, a one-line note
    saying why the tokenizer cannot be carried) when the type is unsupported or a file is not
    found; (None, None) when the args name no tokenizer."""
    tokenizer_type = _arg(args, "tokenizer_type")
    if tokenizer_type is None:
        return None, None
    if tokenizer_type not in TOKENIZER_TYPES:
        return None, (
            f"the checkpoint's --tokenizer-type {tokenizer_type} is not supported here (supported: "
            f"{', '.join(TOKENIZER_TYPES)}); converted without a tokenizer"
        )
    fields, missing = {}, []
    for name in tokenizer_inputs(tokenizer_type):
        if name == "vocab_size":
            fields["vocab_size"] = _arg(args, "vocab_size")
            continue
        given = _arg(args, name)
        name_only = None if given is None else os.path.basename(os.path.normpath(given))
        candidates = [] if given is None else [given] + [os.path.join(d, name_only) for d in search_dirs]
        found = next((c for c in candidates if os.path.exists(c)), None)
        if found is None:
            missing.append(f"--{name.replace('_', '-')} {given}")
        else:
            fields[_TOKENIZER_FIELDS[name]] = os.path.abspath(found)
    if missing:
        return None, (
            f"the checkpoint's tokenizer ({tokenizer_type}, {', '.join(missing)}) is found neither where the run had "
            f"it nor next to the checkpoint in {', '.join(search_dirs)}; converted without a tokenizer (put the "
            "file(s) there to carry it)"
        )
    return TokenizerRecord(tokenizer_type, **fields), None


def _qkv_from_grouped(qkv: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """megatron-core's per-group [q_g; k_g; v_g] rows (weight or bias) as our [Q; K; V]."""
    groups, head_dim = config.num_query_groups or config.num_attention_heads, config.kv_channels
    heads_per_group = config.num_attention_heads // groups
    grouped = qkv.reshape(groups, (heads_per_group + 2) * head_dim, *qkv.shape[1:])
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return torch.cat([part.reshape(-1, *qkv.shape[1:]) for part in (q, k, v)], dim=0).contiguous()


# our per-layer suffix <- megatron-core per-layer suffixes (the first one present is used)
_LAYER_KEYS = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    "input_layernorm.bias": ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    "self_attention.linear_qkv.weight": ("self_attention.linear_qkv.weight",),
    "self_attention.linear_qkv.bias": ("self_attention.linear_qkv.bias",),
    "self_attention.linear_proj.weight": ("self_attention.linear_proj.weight",),
    "self_attention.linear_proj.bias": ("self_attention.linear_proj.bias",),
    "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    "pre_mlp_layernorm.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    "mlp.linear_fc1.weight": ("mlp.linear_fc1.weight",),
    "mlp.linear_fc1.bias": ("mlp.linear_fc1.bias",),
    "mlp.linear_fc2.weight": ("mlp.linear_fc2.weight",),
    "mlp.linear_fc2.bias": ("mlp.linear_fc2.bias",),
}
_TOP_KEYS = (
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)


def state_dict_from_mcore(checkpoint: McoreCheckpoint, expected_keys, config: TransformerConfig) -> dict:
    """Our full GPT state dict with the keys ``expected_keys`` (those of the model to load)."""
    stored = set(checkpoint.tensor_keys())
    out, used = {}, set()
    stacked = {}
    for key in expected_keys:
        if key in _TOP_KEYS:
            if key not in stored:
                raise McoreCheckpointError(f"the checkpoint lacks {key!r}")
            out[key] = checkpoint.tensor(key)
            used.add(key)
            continue
        prefix, layer, suffix = key.split(".", 3)[0:2], key.split(".")[2], key.split(".", 3)[3]
        if prefix != ["decoder", "layers"] or suffix not in _LAYER_KEYS:
            raise McoreCheckpointError(f"our model's parameter {key!r} has no megatron-core counterpart")
        source = next((f"decoder.layers.{s}" for s in _LAYER_KEYS[suffix] if f"decoder.layers.{s}" in stored), None)
        if source is None:
            raise McoreCheckpointError(
                f"the checkpoint lacks any of {['decoder.layers.' + s for s in _LAYER_KEYS[suffix]]}"
            )
        if source not in stacked:
            stacked[source] = checkpoint.tensor(source)
            if stacked[source].shape[0] != config.num_layers:
                raise McoreCheckpointError(
                    f"{source!r} stacks {stacked[source].shape[0]} layers, the model has {config.num_layers}"
                )
        tensor = stacked[source][int(layer)]
        out[key] = _qkv_from_grouped(tensor, config) if suffix.startswith("self_attention.linear_qkv") else tensor
        used.add(source)
    unused = sorted(k for k in stored - used if not k.endswith("_extra_state"))
    if unused:
        raise McoreCheckpointError(
            f"the checkpoint has {len(unused)} tensors our model does not use, e.g. {unused[:3]}"
        )
    return out
