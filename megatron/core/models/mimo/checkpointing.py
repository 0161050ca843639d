"""Sharded checkpoints of a MIMO job, every module through its own process groups.

Each module this rank holds (the language model, each modality submodule) describes its
weights with :func:`model_sharded_state_dict` over that module's own
:class:`ProcessGroupCollection`, under the key prefix of its place in :class:`MimoModel`
(``language_model.``, ``modality_submodules.images.``). Its optimizer (its member of the
:class:`MimoOptimizer` chain) is described over the same collection under
``optimizer.<module name>.``, so the members' singletons (param groups, loss scaler, format
record) never share a key. Replica ids therefore come from the module's own groups (DESIGN.md
section 6): GTP-sharded pieces from its GTP-excluded ``dp_cp`` group, pieces whole on every
GTP peer with its GTP rank included, singletons from its tp, pp, dp, cp and gtp ranks. A rank
holding only some modules contributes only their pieces; saved over the whole job (e.g. with
``dist_checkpointing.save_iteration``) the ranks together cover every module exactly once.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.model_state import (
    CheckpointParam,
    checkpoint_params,
    load_model_pieces,
    model_sharded_state_dict,
    vocab_rows,
)
from megatron.core.dist_checkpointing.optimizer_state import load_optimizer_state, optimizer_sharded_state_dict
from megatron.core.models.mimo.builder import module_parts
from megatron.core.models.mimo.mimo_model import MimoModel
from megatron.core.models.mimo.optimizer import MimoOptimizer
from megatron.core.models.mimo.roles import LANGUAGE_MODEL
from megatron.core.process_groups import ProcessGroupCollection


def module_key_prefix(name: str) -> str:
    """Checkpoint key prefix of module ``name``: its attribute path in :class:`MimoModel`."""
    return f"{LANGUAGE_MODEL}." if name == LANGUAGE_MODEL else f"modality_submodules.{name}."


def optimizer_key_prefix(name: str) -> str:
    """Key prefix of module ``name``'s optimizer state."""
    return f"optimizer.{name}"


def _check_modules(parts: dict, given, what: str, exact: bool = True) -> None:
    """``given`` (a mapping keyed by module name) must name the modules in ``parts``: exactly,
    or at least them when not ``exact``."""
    if set(given) != set(parts) if exact else not set(parts) <= set(given):
        raise CheckpointingError(
            f"this rank holds modules {sorted(parts)} but {what} covers {sorted(given)}; "
            + ("give one entry per held module" if exact else "every held module needs an entry")
        )


def mimo_checkpoint_params(model: MimoModel) -> dict[str, list[CheckpointParam]]:
    """Module name -> the checkpoint description of its parameters (keys with the module prefix)."""
    return {
        name: checkpoint_params(part, module_key_prefix(name), vocab_rows(part))
        for name, part in module_parts(model).items()
    }


def mimo_sharded_state_dict(
    model: MimoModel, collections: dict[str, ProcessGroupCollection], optimizer: MimoOptimizer | None = None
) -> dict:
    """``{"model": {module: pieces}, "optimizer": {module: pieces}}`` of the modules this rank
    holds, each over ``collections[module]`` (the optimizer part only when ``optimizer`` is
    given; a collective over each module's ``dp_cp`` with the distributed optimizer)."""
    parts = module_parts(model)
    _check_modules(parts, collections, "collections")
    if optimizer is not None:
        _check_modules(parts, optimizer.optimizers, "the optimizer chain")
    state = {
        "model": {
            name: model_sharded_state_dict(part, collections[name], module_key_prefix(name), vocab_rows(part))
            for name, part in parts.items()
        }
    }
    if optimizer is not None:
        params = mimo_checkpoint_params(model)
        state["optimizer"] = {
            name: optimizer_sharded_state_dict(
                optimizer.optimizers[name], params[name], collections[name], optimizer_key_prefix(name)
            )
            for name in parts
        }
    return state


def load_mimo_state(model: MimoModel, loaded: dict, optimizer: MimoOptimizer | None = None) -> None:
    """Install what ``dist_checkpointing.load`` returned for :func:`mimo_sharded_state_dict`:
    the weights of every held module and, with ``optimizer``, each member's state."""
    parts = module_parts(model)
    # The loaded tree may also name modules held elsewhere: the saved common state keeps the
    # (emptied) containers of the coordinator's tree.
    _check_modules(parts, loaded["model"], "the loaded model state", exact=False)
    for name, part in parts.items():
        load_model_pieces(part, loaded["model"][name])
    if optimizer is not None:
        _check_modules(parts, optimizer.optimizers, "the optimizer chain")
        params = mimo_checkpoint_params(model)
        for name in parts:
            load_optimizer_state(optimizer.optimizers[name], loaded["optimizer"][name], params[name])
