"""The MoE layer that replaces a dense MLP: router, token dispatcher, grouped experts, and
optional shared experts (a dense MLP every token goes through, added to the routed output).

``forward(hidden [s, b, h]) -> (out [s, b, h], None)``: the MLP's contract, so transformer and
hybrid layers take either. Expert parallelism uses the ``ep`` group of the collection (absent:
EP 1); this rank holds experts ``[ep_rank * E / EP, (ep_rank + 1) * E / EP)``, sharded over
``expt_tp`` when that group has more than one rank (expert tensor parallelism).

Tokens replicated over TP (TP > 1 without sequence parallelism) are split over ``tp`` after
routing and gathered back after the experts, so the expert domain (EP x ETP x expert-DP over the
same ranks) sees every token once: expert gradients summed over ``expt_dp`` and the partial
sums of ``expt_tp`` then count each token once, whatever the expert layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP, MLPSubmodules, call_mlp
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    DISPATCHERS,
    gather_replicated_tokens,
    split_replicated_tokens,
)
from megatron.core.transformer.spec import ModuleSpec, build_module


@dataclass
class MoESubmodules:
    experts: Any = GroupedMLP
    shared_experts: Any = None  # a ModuleSpec of a dense MLP, built when the config sizes one


def expert_parallel_group(pg_collection: ProcessGroupCollection):
    """The collection's ``ep`` group, or None (EP 1) when it provides none."""
    return pg_collection.ep if "ep" in vars(pg_collection) and pg_collection.has("ep") else None


def expert_tensor_parallel_group(pg_collection: ProcessGroupCollection):
    """The collection's ``expt_tp`` group when it has more than one rank, else None (ETP 1)."""
    has = "expt_tp" in vars(pg_collection) and pg_collection.has("expt_tp")
    return pg_collection.expt_tp if has and dist.get_world_size(pg_collection.expt_tp) > 1 else None


def replicated_token_group(config: TransformerConfig, pg_collection: ProcessGroupCollection):
    """The ``tp`` group when the layer's tokens are replicated over it (TP > 1 without sequence
    parallelism), else None."""
    if config.sequence_parallel or not pg_collection.has("tp") or dist.get_world_size(pg_collection.tp) == 1:
        return None
    return pg_collection.tp


def default_shared_experts_spec() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules())


class MoELayer(nn.Module):
    """Routed experts (+ shared experts); see the module docstring."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MoESubmodules | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        submodules = submodules or MoESubmodules()
        pg_collection = resolve_pg_collection(pg_collection)
        self.config = config
        ep_group = expert_parallel_group(pg_collection)
        ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if config.num_moe_experts % ep_size:
            raise ConfigError(
                f"num_moe_experts ({config.num_moe_experts}) must be divisible by the expert-parallel size ({ep_size})"
            )
        self.num_local_experts = config.num_moe_experts // ep_size
        self.local_expert_offset = ep_rank * self.num_local_experts
        etp_group = expert_tensor_parallel_group(pg_collection)
        self.token_split_group = replicated_token_group(config, pg_collection)
        self.router = TopKRouter(config)
        self.experts = build_module(
            submodules.experts,
            config,
            num_local_experts=self.num_local_experts,
            local_expert_offset=self.local_expert_offset,
            etp_rank=0 if etp_group is None else dist.get_rank(etp_group),
            etp_size=1 if etp_group is None else dist.get_world_size(etp_group),
        )
        self.dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_offset, ep_group, ep_size, etp_group
        )
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = build_module(
                submodules.shared_experts or default_shared_experts_spec(),
                config=config,
                pg_collection=pg_collection,
                ffn_hidden_size=config.moe_shared_expert_intermediate_size,
            )

    def forward(self, hidden_states: torch.Tensor):
        seq_length, batch, hidden = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden)
        probs, expert_of_slot = self.router(tokens, seq_length=seq_length)
        if self.token_split_group is None:
            out = self.dispatcher(self.experts, tokens, probs, expert_of_slot)
        else:
            (tokens, probs, expert_of_slot), sizes = split_replicated_tokens(
                (tokens, probs, expert_of_slot), self.token_split_group
            )
            out = self.dispatcher(self.experts, tokens, probs, expert_of_slot)
            out = gather_replicated_tokens(out, sizes, self.token_split_group)
        out = out.view_as(hidden_states)
        if self.shared_experts is not None:
            shared, shared_bias = call_mlp(self.shared_experts, hidden_states, "shared_experts")
            out = out + (shared if shared_bias is None else shared + shared_bias)
        return out, None
