"""A training checkpoint turned into this rank's inference model, tokenizer and record.

Every inference entry point (offline generation, the servers, disaggregated prefill/decode)
loads a checkpoint through :func:`load_inference_model`, so they all build the same model from
the same record: the checkpoint's :class:`ModelRecord` says what to build (no model flags), the
weights are loaded for this run's layout (any TP/PP of the same model), and the record names
the tokenizer (its files travel inside the checkpoint).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.models.model_record import ModelRecord, load_model_weights, model_from_record, read_model_record
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tokenizers.base import MegatronTokenizer
from megatron.core.tokenizers.factory import DEFAULT_TOKENIZER_TYPE, build_tokenizer


def default_device() -> torch.device:
    """The device of this rank's process group: its CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_inference_model(
    load_dir: str,
    pg_collection: ProcessGroupCollection | None,
    device: torch.device | str | None = None,
    *,
    default_tokenizer_type: str = DEFAULT_TOKENIZER_TYPE,
    default_tokenizer_model: str | None = None,
) -> tuple[nn.Module, MegatronTokenizer, ModelRecord]:
    """This rank's pipeline stage of the checkpoint's model, in eval mode, with its weights.

    Args:
        load_dir: a checkpoint root (its ``latest`` tracker names the iteration) or an
            ``iter_*`` directory.
        pg_collection: the layout to build for (None: the global one); any TP/PP works.
        device: where the model goes; None: :func:`default_device`.
        default_tokenizer_type, default_tokenizer_model: the tokenizer when the record names none.

    Returns:
        ``(model, tokenizer, record)``; ``record`` is the checkpoint's record as stored (its
        config may ask for sequence parallelism; the model is built without it: the engine
        runs without it, and it changes no weight, only how activations are split).

    Raises:
        CheckpointingError: ``load_dir`` is not a checkpoint, or its record is of an unknown version.
    """
    record = read_model_record(load_dir)
    inference_config = dataclasses.replace(record.config, sequence_parallel=False)
    model = model_from_record(record.replace(config=inference_config), pg_collection)
    load_model_weights(model, load_dir)
    model = model.to(device if device is not None else default_device()).eval()
    return model, record_tokenizer(record, default_tokenizer_type, default_tokenizer_model), record


def record_tokenizer(
    record: ModelRecord,
    default_tokenizer_type: str = DEFAULT_TOKENIZER_TYPE,
    default_tokenizer_model: str | None = None,
) -> MegatronTokenizer:
    """The tokenizer ``record`` names; the default one when it names none (a model converted
    from an HF directory without a tokenizer.json)."""
    if record.tokenizer is not None:
        return record.tokenizer.build()
    return build_tokenizer(default_tokenizer_type, default_tokenizer_model)
