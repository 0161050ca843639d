"""Save and resume training runs.

A checkpoint is ``<save>/iter_XXXXXXX/`` (a sharded checkpoint, see
``megatron.core.dist_checkpointing``) plus the ``latest`` tracker. It holds:

* ``model`` (``model0``, ``model1``, ... with virtual pipeline stages, one per chunk): the
  weights, keyed with global layer numbers and true shapes (any layout, with or without
  virtual stages, loads it);
* ``optimizer``: fp32 masters, moments, param groups, loss scaler (``optimizer_state``);
* ``train_state``: the :class:`TrainState` of the logging rank (iteration, consumed samples, ...);
* ``rng_state``: every rank's RNG states (restored only under the same layout);
* common values: the LR scheduler state, the saving layout, and the run's model record
  (:class:`megatron.core.models.model_record.ModelRecord`, built once from the flags), which
  is also written as plain JSON to ``model_config.json`` beside the tokenizer's files, so
  that the model rebuilds with no flags and no process group
  (:func:`~megatron.core.models.model_record.read_model_record`).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import (
    CheckpointingError,
    ShardedObject,
    iteration_dir,
    load,
    read_latest_iteration,
)
from megatron.core.dist_checkpointing.model_state import checkpoint_params, load_model_pieces, stored_pieces, vocab_rows
from megatron.core.dist_checkpointing.optimizer_state import load_optimizer_state, optimizer_sharded_state_dict
from megatron.core.models.model_record import save_model_checkpoint
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel.random import get_rng_tracker

LAYOUT_AXES = ("tp", "pp", "dp", "cp", "gtp")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model inside a DistributedDataParallel wrapper."""
    return getattr(model, "module", model)


def model_state_keys(trainer) -> list[str]:
    """Where each model chunk's weights go in the state dict: ``model`` without virtual
    stages, ``model0``, ``model1``, ... with them (Megatron's names). The pieces themselves are
    keyed by global layer numbers, so either form loads into the other."""
    chunks = trainer.model_chunks
    return ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]


def _model_states(trainer) -> dict:
    return {
        key: unwrap_model(chunk).sharded_state_dict()
        for key, chunk in zip(model_state_keys(trainer), trainer.model_chunks, strict=True)
    }


def _checkpoint_params(trainer) -> list:
    """The checkpoint parameters of every chunk, local names made distinct by the chunk's key."""
    params = []
    for key, chunk in zip(model_state_keys(trainer), trainer.model_chunks, strict=True):
        model = unwrap_model(chunk)
        specs = checkpoint_params(model, "", vocab_rows(model))
        params += specs if key == "model" else [dataclasses.replace(spec, name=f"{key}.{spec.name}") for spec in specs]
    return params


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


def save_checkpoint(trainer) -> str:
    """Save the trainer's model, optimizer, scheduler, train state and RNG states under
    ``--save`` as ``iter_<iteration>``; returns the directory. With ``--async-save``
    (``trainer.checkpoint_saver``) this takes a snapshot and the save completes in the
    background (see :mod:`megatron.core.dist_checkpointing.async_save`)."""
    args, pg = trainer.args, trainer.pgc
    params = _checkpoint_params(trainer)
    state_dict = {
        **_model_states(trainer),
        "optimizer": optimizer_sharded_state_dict(trainer.optimizer, params, pg),
        "train_state": train_state_object(dataclasses.asdict(trainer.state), trainer.is_logging_rank),
        "rng_state": rng_object(rng_states()),
        "scheduler": trainer.scheduler.state_dict(),
        "layout": _layout(pg),
    }
    iteration, saver = trainer.state.iteration, trainer.checkpoint_saver
    path = iteration_dir(args.save, iteration)

    def report():
        if dist.get_rank() == 0:
            when = "" if saver is None else f", in the background; complete at iteration {trainer.state.iteration}"
            print(f"saved checkpoint {path} (iteration {iteration}{when})", flush=True)

    save_model_checkpoint(
        state_dict,
        args.save,
        iteration,
        trainer.record,
        async_saver=saver,
        on_saved=report,
        retain_interval=args.save_retain_interval,
    )
    return path


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
    params = _checkpoint_params(trainer)
    resume = not args.finetune
    with_optimizer = resume and not args.no_load_optim and "optimizer" in common
    with_train_state = resume and "scheduler" in common  # converted checkpoints hold weights only
    with_rng = resume and not args.no_load_rng and common.get("layout") == _layout(pg)
    request = {
        key: stored_pieces(unwrap_model(chunk), pieces, checkpoint_dir)
        for (key, pieces), chunk in zip(_model_states(trainer).items(), trainer.model_chunks, strict=True)
    }
    if with_optimizer:
        request["optimizer"] = optimizer_sharded_state_dict(trainer.optimizer, params, pg)
    if with_train_state:
        request["train_state"] = train_state_object(None, True)
    if with_rng:
        request["rng_state"] = rng_object(None)
    loaded = load(request, checkpoint_dir)
    for key, chunk in zip(model_state_keys(trainer), trainer.model_chunks, strict=True):
        load_model_pieces(unwrap_model(chunk), loaded[key])
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
