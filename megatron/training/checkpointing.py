"""Save and resume training runs; rebuild a model from a checkpoint with no model flags.

A checkpoint is ``<save>/iter_XXXXXXX/`` (a sharded checkpoint, see
``megatron.core.dist_checkpointing``) plus the ``latest`` tracker. It holds:

* ``model``: the weights, keyed with global layer numbers and true shapes (any layout loads it);
* ``optimizer``: fp32 masters, moments, param groups, loss scaler (``optimizer_state``);
* ``train_state``: the :class:`TrainState` of the logging rank (iteration, consumed samples, ...);
* ``rng_state``: every rank's RNG states (restored only under the same layout);
* common values: the LR scheduler state, the saving layout, and the model-config record,
  which is also written as plain JSON to ``model_config.json`` so that
  :func:`load_model_config` needs no process group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.config import TransformerConfig
from megatron.core.dist_checkpointing import (
    CheckpointingError,
    ShardedObject,
    iteration_dir,
    load,
    read_latest_iteration,
    save,
    write_latest_iteration,
)
from megatron.core.dist_checkpointing.core import write_file_atomically
from megatron.core.dist_checkpointing.model_state import checkpoint_params, load_model_pieces, vocab_rows
from megatron.core.dist_checkpointing.optimizer_state import load_optimizer_state, optimizer_sharded_state_dict
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel.random import get_rng_tracker

MODEL_CONFIG_FILENAME = "model_config.json"
RECORD_VERSION = 1
MODEL_FAMILIES = ("gpt", "hybrid")
LAYOUT_AXES = ("tp", "pp", "dp", "cp", "gtp")


# ------------------------------------------------------------------ model-config record


def model_config_record(
    family: str,
    config: TransformerConfig,
    model_kwargs: dict,
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
) -> dict:
    """What rebuilds the model with no flags: the family (``gpt`` or ``hybrid``), the
    TransformerConfig (its parallel sizes are the default layout) and the model constructor's
    keyword arguments (``vocab_size``, ``max_sequence_length``, ``position_embedding_type``,
    ``share_embeddings_and_output_weights``, RoPE settings, ``hybrid_layer_pattern``)."""
    if family not in MODEL_FAMILIES:
        raise CheckpointingError(f"model family {family!r} is unknown; accepted: {MODEL_FAMILIES}")
    return {
        "version": RECORD_VERSION,
        "model_family": family,
        "transformer_config": config.to_dict(),
        "model_kwargs": dict(model_kwargs),
        "tokenizer_type": tokenizer_type,
        "tokenizer_model": tokenizer_model,
    }


def record_from_args(args, config: TransformerConfig, vocab_size: int) -> dict:
    """The model-config record of a run started from the pretraining flags."""
    kwargs = {
        "vocab_size": vocab_size,
        "max_sequence_length": args.max_position_embeddings,
        "position_embedding_type": args.position_embedding_type,
        "rotary_percent": args.rotary_percent,
        "rotary_base": args.rotary_base,
        "share_embeddings_and_output_weights": not args.untie_embeddings_and_output_weights,
    }
    if args.model_family == "hybrid":
        kwargs["hybrid_layer_pattern"] = args.hybrid_layer_pattern
    return model_config_record(args.model_family, config, kwargs, args.tokenizer_type, args.tokenizer_model)


def resolve_checkpoint_dir(path: str) -> str:
    """``path`` itself when it is an ``iter_*`` directory, else the iteration its tracker names."""
    if os.path.isfile(os.path.join(path, MODEL_CONFIG_FILENAME)):
        return path
    iteration = read_latest_iteration(path)
    if iteration is None:
        raise CheckpointingError(
            f"{path} is neither a checkpoint iteration directory (no {MODEL_CONFIG_FILENAME}) nor a checkpoint root "
            "(no latest_checkpointed_iteration.txt)"
        )
    return iteration_dir(path, iteration)


def load_model_config(path: str) -> dict:
    """The model-config record of a checkpoint (root or iteration directory); a plain JSON read."""
    with open(os.path.join(resolve_checkpoint_dir(path), MODEL_CONFIG_FILENAME), encoding="utf-8") as f:
        record = json.load(f)
    if record.get("version") != RECORD_VERSION:
        raise CheckpointingError(f"model-config record version {record.get('version')!r} is not {RECORD_VERSION}")
    return record


def config_from_record(record: dict, pg_collection: ProcessGroupCollection | None = None) -> TransformerConfig:
    """The record's TransformerConfig; with a collection, its parallel sizes follow the collection."""
    data = dict(record["transformer_config"])
    if pg_collection is not None:
        tp = pg_collection.size("tp")
        data.update(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pg_collection.size("pp"),
            generalized_tensor_parallel_size=pg_collection.size("gtp"),
            context_parallel_size=pg_collection.size("cp") if pg_collection.has("cp") else 1,
            sequence_parallel=bool(data.get("sequence_parallel")) and tp > 1,
        )
    return TransformerConfig.from_dict(data)


def model_from_record(record: dict, pg_collection: ProcessGroupCollection | None = None, **overrides):
    """This pipeline stage's model as the record describes it, for the layout of
    ``pg_collection``; ``overrides`` replace constructor arguments (e.g. ``parallel_output``)."""
    pg = resolve_pg_collection(pg_collection)
    config = config_from_record(record, pg)
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    kwargs = {
        "pre_process": pp_rank == 0,
        "post_process": pp_rank == pp_size - 1,
        **record["model_kwargs"],
        "pg_collection": pg,
        **overrides,
    }
    family = record["model_family"]
    if family == "gpt":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

        spec = get_gpt_layer_local_spec()
        mtp = get_gpt_mtp_block_spec(spec) if config.mtp_num_layers else None
        return GPTModel(config, spec, mtp_block_spec=mtp, **kwargs)
    if family == "hybrid":
        from megatron.core.models.hybrid import HybridModel
        from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec

        return HybridModel(config, get_hybrid_stack_local_spec(), **kwargs)
    raise CheckpointingError(f"model family {family!r} is unknown; accepted: {MODEL_FAMILIES}")


# ------------------------------------------------------------------ saving and loading


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model inside a DistributedDataParallel wrapper."""
    return getattr(model, "module", model)


def _layout(pg: ProcessGroupCollection) -> dict[str, int]:
    return {axis: pg.size(axis) if axis == "gtp" or pg.has(axis) else 1 for axis in LAYOUT_AXES}


def rng_states() -> dict:
    states = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    get_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def rng_object(data) -> ShardedObject:
    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),))


def train_state_object(data, main: bool) -> ShardedObject:
    return ShardedObject("train_state", data, (1,), (0,), replica_id=0 if main else 1)


def save_model_checkpoint(sharded_state_dict: dict, root: str, iteration: int, record: dict) -> str:
    """Collectively save ``sharded_state_dict`` plus the model-config ``record`` as iteration
    ``iteration`` of ``root``, write the record as JSON beside it, then move the tracker
    (so the tracker only ever names directories that have their JSON record)."""
    path = iteration_dir(root, iteration)
    save({**sharded_state_dict, "model_config": record}, path)
    if dist.get_rank() == 0:
        write_file_atomically(os.path.join(path, MODEL_CONFIG_FILENAME), json.dumps(record, indent=1).encode())
    dist.barrier()
    if dist.get_rank() == 0:
        write_latest_iteration(root, iteration)
    dist.barrier()
    return path


def save_checkpoint(trainer) -> str:
    """Save the trainer's model, optimizer, scheduler, train state and RNG states under
    ``--save`` as ``iter_<iteration>``; returns the directory."""
    args, pg = trainer.args, trainer.pgc
    model = unwrap_model(trainer.model)
    params = checkpoint_params(model, "", vocab_rows(model))
    state_dict = {
        "model": model.sharded_state_dict(),
        "optimizer": optimizer_sharded_state_dict(trainer.optimizer, params, pg),
        "train_state": train_state_object(dataclasses.asdict(trainer.state), trainer.is_logging_rank),
        "rng_state": rng_object(rng_states()),
        "scheduler": trainer.scheduler.state_dict(),
        "layout": _layout(pg),
    }
    record = record_from_args(args, trainer.config, trainer.vocab_size)
    path = save_model_checkpoint(state_dict, args.save, trainer.state.iteration, record)
    if dist.get_rank() == 0:
        print(f"saved checkpoint {path} (iteration {trainer.state.iteration})", flush=True)
    return path


def load_model_weights(model: torch.nn.Module, path: str) -> str:
    """Load only the weights of the checkpoint at ``path`` (root or iteration directory) into
    ``model`` (any layout); returns the directory read."""
    checkpoint_dir = resolve_checkpoint_dir(path)
    model = unwrap_model(model)
    loaded = load({"model": model.sharded_state_dict()}, checkpoint_dir)
    load_model_pieces(model, loaded["model"])
    return checkpoint_dir


def scheduler_mismatch_policy(args) -> str:
    if args.override_opt_param_scheduler:
        return "use_current"
    return "use_checkpoint" if args.use_checkpoint_opt_param_scheduler else "error"


def load_checkpoint(trainer) -> None:
    """Resume from ``--load`` (the iteration its tracker names).

    Loads the weights always; with ``--finetune`` nothing else (iteration 0, fresh optimizer
    and schedule). Otherwise also the train state (iteration, consumed samples), the LR
    schedule (``--override-opt-param-scheduler`` / ``--use-checkpoint-opt-param-scheduler``
    settle disagreements), the optimizer state unless ``--no-load-optim`` (or the checkpoint
    has none, e.g. a converted one) and the RNG states unless ``--no-load-rng`` or the layout
    changed. Prints what was loaded.
    """
    args, pg = trainer.args, trainer.pgc
    iteration = read_latest_iteration(args.load)
    if iteration is None:
        raise CheckpointingError(f"--load {args.load}: no latest_checkpointed_iteration.txt tracker there")
    checkpoint_dir = iteration_dir(args.load, iteration)
    common = load({}, checkpoint_dir)
    model = unwrap_model(trainer.model)
    params = checkpoint_params(model, "", vocab_rows(model))
    resume = not args.finetune
    with_optimizer = resume and not args.no_load_optim and "optimizer" in common
    with_train_state = resume and "scheduler" in common  # converted checkpoints hold weights only
    with_rng = resume and not args.no_load_rng and common.get("layout") == _layout(pg)
    request = {"model": model.sharded_state_dict()}
    if with_optimizer:
        request["optimizer"] = optimizer_sharded_state_dict(trainer.optimizer, params, pg)
    if with_train_state:
        request["train_state"] = train_state_object(None, True)
    if with_rng:
        request["rng_state"] = rng_object(None)
    loaded = load(request, checkpoint_dir)
    load_model_pieces(model, loaded["model"])
    loaded_parts = ["model weights"]
    if with_optimizer:
        load_optimizer_state(trainer.optimizer, loaded["optimizer"], params)
        loaded_parts.append("optimizer state")
    else:
        trainer.optimizer.reload_model_params()
    if with_train_state:
        trainer.state = type(trainer.state).from_dict(loaded["train_state"])
        trainer.scheduler.load_state_dict(common["scheduler"], on_mismatch=scheduler_mismatch_policy(args))
        loaded_parts.append(
            f"train state (iteration {trainer.state.iteration}, consumed samples {trainer.state.consumed_samples}), "
            "LR schedule"
        )
    if with_rng:
        set_rng_states(loaded["rng_state"])
        loaded_parts.append("RNG states")
    if dist.get_rank() == 0:
        print(f"loaded checkpoint {checkpoint_dir}: " + ", ".join(loaded_parts), flush=True)
