"""An optimizer's sharded state dict: per-parameter state with the geometry of its parameter.

fp32 masters and the torch optimizer's tensor state (Adam ``exp_avg`` / ``exp_avg_sq``, SGD
``momentum_buffer``) are stored as ``<prefix>.state.<name>.<param key>`` (prefix ``optimizer``
unless the caller picks another, e.g. one per module of a job with several optimizers), described by
:func:`model_state.describe_tensor` exactly like the parameter, so they reshard to any
TP/PP/DP/GTP layout. The distributed optimizer holds flat element ranges of its parameters:
it sums its ranges over its shard group (``dp_cp``, ``expt_dp`` for expert parameters, or one
distributed-optimizer instance of them) into parameter-shaped
tensors before saving (only replica 0's copy is main) and takes its ranges back after loading.

Everything else is a singleton :class:`ShardedObject` with the replica id of every replicating
axis (``singleton_replica_id``): per member ``param_groups`` (hyperparameters and the step
count, matched on load by ``(lr_mult, wd_mult)``), the loss scaler, and the format record.
Missing state (before the first step) is saved as zeros with step 0, which the torch
optimizers treat like a fresh start.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.dist_utils import all_gather_object
from megatron.core.dist_checkpointing.errors import CheckpointingError
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.model_state import CheckpointParam, describe_tensor
from megatron.core.dist_checkpointing.sharding import singleton_replica_id
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel.collectives import all_reduce_coalesced

STATE_FORMAT = "param_shaped_v1"
FP32_PARAM = "fp32_param"


def _members(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _state_names(member) -> tuple[str, ...]:
    """Tensor states the member's torch optimizer keeps per parameter (whether created yet or not)."""
    config = member.config
    if config.optimizer == "adam":
        return ("exp_avg", "exp_avg_sq")
    if config.optimizer == "muon":
        return ("momentum_buffer",)
    return ("momentum_buffer",) if config.sgd_momentum else ()


def _is_distributed(member) -> bool:
    return hasattr(member, "buffers") and hasattr(member, "shard_domains")


def _params(member) -> list[torch.nn.Parameter]:
    """Every model parameter the member stands for, in an order all dp_cp replicas share."""
    if _is_distributed(member):
        return member.params
    return [entry.model_param for entry in member.master_params]


def _group_index(member) -> dict[int, int]:
    """id(master tensor) -> index of its torch param group."""
    return {id(t): i for i, group in enumerate(member.optimizer.param_groups) for t in group["params"]}


def _param_shaped_states(member, pg: ProcessGroupCollection) -> dict[str, dict[int, torch.Tensor]]:
    """``{state name: {id(param): param-shaped fp32 tensor}}`` including ``fp32_param``."""
    names = _state_names(member) + (FP32_PARAM,)
    params = _params(member)
    full = {name: {id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params} for name in names}
    for entry in member.master_params:
        state = member.optimizer.state.get(entry.master, {})
        for name in names:
            value = entry.master.detach() if name == FP32_PARAM else state.get(name)
            if value is not None:
                entry.model_view(full[name][id(entry.model_param)]).copy_(
                    value.reshape(-1) if entry.start is not None else value
                )
    if not _is_distributed(member):
        return full
    # Expert parameters are sharded over their own replicas (expt_dp), dense ones over dp_cp (or
    # over this rank's distributed-optimizer instance of them).
    for group, domain in member.shard_domains(params):
        if dist.get_world_size(group) > 1:  # the ranges are disjoint: the sum is the whole
            all_reduce_coalesced([full[name][id(p)] for name in names for p in domain], group)
    return full


def _group_records(member, pg: ProcessGroupCollection) -> list[dict]:
    """Hyperparameters and step count of every torch param group (steps agreed over dp_cp)."""
    groups = member.optimizer.param_groups
    steps = torch.zeros(len(groups), dtype=torch.float64)
    index = _group_index(member)
    for entry in member.master_params:
        step = member.optimizer.state.get(entry.master, {}).get("step")
        if step is not None:
            i = index[id(entry.master)]
            steps[i] = max(steps[i].item(), float(step))
    if _is_distributed(member) and pg.size("dp_cp") > 1:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=pg.dp_cp)
    records = [
        {**{k: v for k, v in group.items() if k != "params"}, "step": int(step)}
        for group, step in zip(groups, steps.tolist(), strict=True)
    ]
    # One rank saves the records: they must name the groups of every stage and shard (a pipeline
    # stage without norms or biases has no undecayed group, say).
    by_mults = {}
    for record in (r for records_of_rank in all_gather_object(records, pg.mp) for r in records_of_rank):
        mults = _group_key_of(record)
        if mults not in by_mults or record["step"] > by_mults[mults]["step"]:
            by_mults[mults] = record
    return [by_mults[mults] for mults in sorted(by_mults)]


def _group_key_of(group: dict) -> tuple:
    """What matches a saved param group to a local one: ``(lr_mult, wd_mult, is_decoupled_lr)``
    (older checkpoints have no decoupled groups)."""
    return (group.get("lr_mult", 1.0), group.get("wd_mult", 1.0), bool(group.get("is_decoupled_lr", False)))


def _object(key: str, data, pg: ProcessGroupCollection) -> ShardedObject:
    return ShardedObject(key, data, (1,), (0,), replica_id=singleton_replica_id(pg))


def _group_key(optimizer, index: int, key_prefix: str) -> str:
    if len(_members(optimizer)) == 1:
        return f"{key_prefix}.param_groups"
    return f"{key_prefix}.member{index}.param_groups"


def optimizer_sharded_state_dict(
    optimizer, params: list[CheckpointParam], pg: ProcessGroupCollection, key_prefix: str = "optimizer"
) -> dict:
    """Sharded state of a MegatronOptimizer, DistributedOptimizer or ChainedOptimizer.

    ``params`` describes the model's parameters (``model_state.checkpoint_params``); every
    parameter the optimizer steps must be among them. Every key starts with ``key_prefix``:
    optimizers saved into one checkpoint next to each other (each over its own ``pg``, e.g.
    one per module of a MIMO job) need distinct prefixes. A collective over ``dp_cp`` for the
    distributed optimizer.
    """
    specs = {id(spec.param): spec for spec in params}
    members = _members(optimizer)
    out = {
        "state": {},
        "param_groups": [
            _object(_group_key(optimizer, i, key_prefix), _group_records(m, pg), pg) for i, m in enumerate(members)
        ],
        "format": _object(f"{key_prefix}.format", {"format": STATE_FORMAT, "members": len(members)}, pg),
    }
    scaler = members[0].grad_scaler
    if scaler is not None:
        out["grad_scaler"] = _object(f"{key_prefix}.grad_scaler", scaler.state_dict(), pg)
    for member in members:
        for name, by_param in _param_shaped_states(member, pg).items():
            for param in _params(member):
                spec = specs.get(id(param))
                if spec is None:
                    raise CheckpointingError(
                        f"the optimizer steps a parameter of shape {tuple(param.shape)} that is not among the model's "
                        "checkpoint parameters; pass the parameters of every model chunk the optimizer covers"
                    )
                out["state"].setdefault(name, {})[spec.name] = describe_tensor(
                    f"{key_prefix}.state.{name}.{spec.key}", by_param[id(param)], spec, pg
                )
    return out


@torch.no_grad()
def load_optimizer_state(optimizer, loaded: dict, params: list[CheckpointParam]) -> None:
    """Install state loaded for :func:`optimizer_sharded_state_dict` (same ``params``)."""
    fmt = loaded["format"]
    if fmt.get("format") != STATE_FORMAT:
        raise CheckpointingError(f"optimizer state format {fmt.get('format')!r} is not {STATE_FORMAT!r}")
    members = _members(optimizer)
    if fmt["members"] != len(members):
        raise CheckpointingError(
            f"the checkpoint holds the state of {fmt['members']} chained optimizer(s) but this run has {len(members)}"
        )
    names_of = {id(spec.param): spec.name for spec in params}
    for member, saved_groups in zip(members, loaded["param_groups"], strict=True):
        steps = _restore_groups(member, saved_groups)
        index = _group_index(member)
        for entry in member.master_params:
            name = names_of[id(entry.model_param)]
            state = {"step": torch.tensor(float(steps[index[id(entry.master)]]))}
            for state_name in _state_names(member):
                piece = entry.model_view(loaded["state"][state_name][name])
                state[state_name] = piece.reshape(entry.master.shape).to(entry.master.dtype).clone()
            member.optimizer.state[entry.master] = state
            entry.master.copy_(entry.model_view(loaded["state"][FP32_PARAM][name]).reshape(entry.master.shape))
            if entry.is_copy:
                entry.model_view(entry.model_param.data).copy_(entry.master)
    if members[0].grad_scaler is not None and "grad_scaler" in loaded:
        members[0].grad_scaler.load_state_dict(loaded["grad_scaler"])


def _restore_groups(member, saved_groups: list[dict]) -> list[int]:
    """Copy the saved hyperparameters into the matching local groups; return their steps."""
    by_mults = {_group_key_of(g): g for g in saved_groups}
    steps = []
    for group in member.optimizer.param_groups:
        mults = _group_key_of(group)
        # a run that (un)sets --decoupled-lr resumes its embeddings' groups from their old ones
        saved = by_mults.get(mults, by_mults.get((*mults[:2], not mults[2])))
        if saved is None:
            raise CheckpointingError(
                f"no saved optimizer param group has (lr_mult, wd_mult, is_decoupled_lr) = {mults}; the checkpoint "
                f"has {sorted(by_mults)}"
            )
        for key, value in saved.items():
            if key in group and key not in ("params", "is_decoupled_lr"):
                group[key] = value
        steps.append(saved["step"])
    return steps
