"""Distributed optimizer: fp32 masters and optimizer state sharded over the ``dp_cp`` replicas
(expert parameters: over the ``expt_dp`` replicas), or over this rank's instance of them with
several distributed-optimizer instances: the group of their DDP buffers.

It works on the flat buffers of :class:`~megatron.core.distributed.DistributedDataParallel`
built with ``use_distributed_optimizer=True``: DDP reduce-scatters each bucket's gradients so
that replica ``r`` holds the reduced values of its contiguous ``1/|dp_cp|`` shard of the
bucket. This optimizer makes masters (and so Adam state) only for the pieces of parameters
that fall in this replica's shards, steps them, writes them into the flat parameter buffer
and all-gathers every bucket so all replicas see all updated parameters: blocking at the end
of the step, or, for buffers built with ``overlap_param_gather``, launched there and finished
by the model's forward pre-hooks in the next forward pass.
"""

from __future__ import annotations

import torch

from megatron.core.optimizer.optimizer import MasterParam, MegatronOptimizer


class DistributedOptimizer(MegatronOptimizer):
    """:class:`MegatronOptimizer` whose masters are this replica's shards of the DDP buffers.

    Args (besides those of :class:`MegatronOptimizer`):
        buffers: the ``ParamAndGradBuffer`` objects of the DDP-wrapped model chunks; every
            parameter in ``param_groups`` must live in one of them.
    """

    def __init__(self, config, param_groups, pg_collection, grad_scaler, buffers, matrices=None):
        self.buffers = list(buffers)
        self._buffer_of = {param: buffer for buffer in self.buffers for param in buffer.params}
        self._stepped = {id(param) for group in param_groups for param in group["params"]}
        # Chained members share the buffers: only the last one to step gathers them (see get_megatron_optimizer).
        self.gathers_params = True
        super().__init__(config, param_groups, pg_collection, grad_scaler, matrices)

    @property
    def params(self) -> list:
        """The parameters this optimizer steps, in buffer order (the same on every replica)."""
        return [param for buffer in self.buffers for param in buffer.params if id(param) in self._stepped]

    def _replica_groups(self, matrices: dict) -> list:
        """Muon's matrices by the group their pieces are sharded over (:meth:`shard_domains`)."""
        ordered = [matrices[id(param)] for param in self.params if id(param) in matrices]
        return self.shard_domains(ordered, lambda matrix: matrix.param)

    def shard_domains(self, items: list, param_of=lambda item: item) -> list[tuple]:
        """``(group, items)`` by the group the pieces of each item's parameter (``param_of``) are
        sharded over (:meth:`shard_group`): one domain when dense and expert parameters share it."""
        dense_group, expert_group = self.shard_group(), self.shard_group(expert=True)
        if expert_group is dense_group:
            return [(dense_group, list(items))]
        expert = [getattr(param_of(item), "is_expert", False) for item in items]
        return [
            (dense_group, [item for item, is_expert in zip(items, expert, strict=True) if not is_expert]),
            (expert_group, [item for item, is_expert in zip(items, expert, strict=True) if is_expert]),
        ]

    def _master_entries(self, param) -> list[MasterParam]:
        """The piece of ``param`` inside this replica's shard of its bucket (possibly none)."""
        buffer = self._buffer_of[param]
        param_start, param_end = buffer.param_range(param)
        shard_start, shard_end = buffer.bucket_of(param).shard_range()
        start, end = max(param_start, shard_start), min(param_end, shard_end)
        if start >= end:
            return []
        return [self._make_master(param, start - param_start, end - param_start)]

    def shard_group(self, expert: bool = False):
        """The group whose members hold the disjoint shards of the (expert) parameters: the
        buffers' replica group, ``dp_cp`` / ``expt_dp`` or, with several distributed-optimizer
        instances, this rank's instance of it."""
        for buffer in self.buffers:
            if bool(getattr(buffer.params[0], "is_expert", False)) == expert:
                return buffer.group
        return self.pg_collection.expert_dp_group() if expert else self.pg_collection.dp_cp

    def _sum_groups(self, expert: bool = False) -> list:
        pgc = self.pg_collection
        return [pgc.expert_mp_group() if expert else pgc.mp, self.shard_group(expert)]

    def step_with_ready_grads(self) -> None:
        # A gather no forward pass waited for (a bucket of unused parameters) must not run
        # while the step rewrites this replica's shards.
        self.finish_param_sync()
        super().step_with_ready_grads()

    def _gather_params(self) -> None:
        if not self.gathers_params:
            return
        for buffer in self.buffers:
            buffer.start_param_sync()
        for buffer in self.buffers:
            if not buffer.overlap_param_gather:
                buffer.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter gather still in flight."""
        for buffer in self.buffers:
            buffer.finish_param_sync()

    def shard_ranges(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        """``(model_param, start, end)`` flat element ranges owned here, in state-index order."""
        return [(entry.model_param, entry.start, entry.end) for entry in self.master_params]
