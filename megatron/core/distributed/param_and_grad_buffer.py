"""Flat per-dtype gradient (and parameter) buffers, split into buckets reduced as one.

Every parameter gets a fixed range of one flat buffer; ``param.main_grad`` is a view of its
range, so a bucket's gradients are reduced with a single collective. The parameter data becomes
a view of the same range of a matching flat parameter buffer, so one kernel can step every
parameter of the buffer (:mod:`megatron.core.optimizer.flat_adamw`). With the distributed
optimizer each bucket is padded to a multiple of the replica-group size (times
:data:`SHARD_ALIGNMENT`) so that every replica owns an equal, contiguous shard: rank ``r`` owns
``[r * S, (r + 1) * S)`` of each bucket.

Every collective is launched asynchronously and waited on separately, so the gradient
reductions of early buckets run while backward still computes later ones, and the parameter
gathers while forward already uses earlier ones (see ``DistributedDataParallel``).

Gloo has no reduce-scatter or all-gather into one tensor: on gloo groups a "reduce-scatter"
is an in-place all-reduce of the bucket (the owned shard is a view of it, so it holds the
reduced values; the rest does too, which is harmless), and the parameter all-gather uses
list ``all_gather`` into views of the bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.errors import MegatronRuntimeError
from megatron.core.process_groups import new_group_cached

# With the distributed optimizer each bucket is padded to a multiple of (replicas x this many)
# elements, so every shard starts and ends on a 16-byte boundary of bf16 (and fp32) data: the
# vectorized variant of FlatAdamW's kernel then steps whole shards of aligned layers.
SHARD_ALIGNMENT = 8


class GradSyncOrderError(MegatronRuntimeError):
    """A gradient arrived for a bucket whose reduction had already started."""


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class GradBucket:
    """A contiguous range of a buffer whose gradients are reduced, and whose parameters are
    gathered, by one collective each.

    ``grad_data``/``param_data`` are views of the owning buffer. ``offset`` is where the bucket
    starts in the buffer. Both collectives are asynchronous: ``start_*`` launches, ``finish_*``
    waits (and is a no-op when nothing is in flight).
    """

    def __init__(
        self, index, params, offset, grad_data, param_data, group, scaling_factor, sharded, instance_group=None
    ):
        self.index = index
        self.params = list(params)
        self.offset = offset
        self.grad_data = grad_data
        self.param_data = param_data
        self.group = group
        self.scaling_factor = scaling_factor
        self.sharded = sharded
        self.instance_group = instance_group
        self._world = dist.get_world_size(group)
        self._pending = set(self.params)
        self._launched = False
        self._grad_handle = None
        self._param_handle = None

    @property
    def shard_numel(self) -> int:
        return self.grad_data.numel() // self._world

    def shard_range(self) -> tuple[int, int]:
        """``[start, end)`` in buffer coordinates of the shard this replica owns."""
        start = self.offset + dist.get_rank(self.group) * self.shard_numel
        return start, start + self.shard_numel

    def mark_ready(self, param) -> None:
        self._pending.discard(param)

    @property
    def all_ready(self) -> bool:
        return not self._pending

    @property
    def launched(self) -> bool:
        return self._launched

    def start_grad_sync(self) -> None:
        """Scale the gradients and launch their asynchronous reduction over the replicas."""
        if self._launched:
            return
        self._launched = True
        if self.scaling_factor != 1.0:
            self.grad_data.mul_(self.scaling_factor)
        if self._world == 1:
            return
        if self.sharded and not _is_gloo(self.group):
            start, end = self.shard_range()
            local = self.grad_data.narrow(0, start - self.offset, end - start)
            self._grad_handle = dist.reduce_scatter_tensor(local, self.grad_data, group=self.group, async_op=True)
        else:
            self._grad_handle = dist.all_reduce(self.grad_data, group=self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait for the reduction (launching it first if nothing did), then re-arm the bucket.
        With distributed-optimizer instances the owned shard is then summed across them."""
        self.start_grad_sync()
        if self._grad_handle is not None:
            self._grad_handle.wait()
        if self.instance_group is not None and dist.get_world_size(self.instance_group) > 1:
            start, end = self.shard_range()
            dist.all_reduce(self.grad_data.narrow(0, start - self.offset, end - start), group=self.instance_group)
        self.reset()

    def reset(self) -> None:
        self._pending = set(self.params)
        self._launched = False
        self._grad_handle = None

    def start_param_sync(self) -> None:
        """Launch the rebuild of the whole bucket of parameters from every replica's owned
        shard (a gather still in flight on this bucket is finished first)."""
        self.finish_param_sync()
        if self._world == 1:
            return
        pieces = list(self.param_data.split(self.shard_numel))
        mine = pieces[dist.get_rank(self.group)]
        if _is_gloo(self.group):
            self._param_handle = dist.all_gather(pieces, mine, group=self.group, async_op=True)
        else:
            self._param_handle = dist.all_gather_into_tensor(
                self.param_data, mine.clone(), group=self.group, async_op=True
            )

    def finish_param_sync(self) -> None:
        """Wait for the parameter gather in flight, if any."""
        if self._param_handle is not None:
            self._param_handle.wait()
            self._param_handle = None


def split_into_instances(group, instances: int):
    """``(this rank's instance, the ranks owning the same shards in the other instances)`` of a
    replica ``group`` split into ``instances`` runs of consecutive group ranks; ``(group, None)``
    for one instance."""
    if instances == 1:
        return group, None
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) % instances:
        raise MegatronRuntimeError(
            f"num_distributed_optimizer_instances ({instances}) must divide the {len(ranks)} replicas of the "
            "data-parallel group"
        )
    size, me = len(ranks) // instances, ranks.index(dist.get_rank())
    first = me - me % size
    return new_group_cached(ranks[first : first + size]), new_group_cached(ranks[me % size :: size])


class ParamAndGradBuffer:
    """One flat gradient buffer (and, for the distributed optimizer, parameter buffer) for
    parameters of one dtype, cut into buckets.

    Args:
        params: parameters in the order their gradients are expected (reverse of creation).
        grad_dtype: dtype of ``param.main_grad`` and of the reduction.
        group: the replica group the gradients are reduced over (``dp_cp``); with
            distributed-optimizer instances, this rank's instance of it.
        instance_group: the ranks of the other instances that own the same shards (None: one
            instance); each owned shard is all-reduced over it after the reduce-scatter.
        scaling_factor: gradients are multiplied by this just before the (sum) reduction.
        bucket_size: elements per bucket, or None for one bucket.
        for_distributed_optimizer: pad buckets for even sharding and reduce-scatter.
        overlap_param_gather: the parameter gathers the optimizer starts are finished by the
            model's forward pre-hooks (DDP installs them), not by the optimizer step.
    """

    def __init__(
        self,
        params,
        grad_dtype,
        group,
        scaling_factor,
        bucket_size,
        for_distributed_optimizer,
        overlap_param_gather=False,
        instance_group=None,
    ):
        params = list(params)
        self.overlap_param_gather = overlap_param_gather
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.group = group
        world = dist.get_world_size(group)
        self._ranges: dict[torch.nn.Parameter, tuple[int, int]] = {}
        bucket_layout: list[tuple[int, int, list]] = []
        offset = bucket_start = 0
        members: list = []
        for param in params:
            self._ranges[param] = (offset, offset + param.numel())
            offset += param.numel()
            members.append(param)
            if param is params[-1] or (bucket_size is not None and offset - bucket_start >= bucket_size):
                if for_distributed_optimizer:
                    offset = -(-offset // (world * SHARD_ALIGNMENT)) * world * SHARD_ALIGNMENT
                bucket_layout.append((bucket_start, offset, members))
                bucket_start, members = offset, []
        self.numel = offset
        device = params[0].device
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        for param, (start, end) in self._ranges.items():
            self.param_data[start:end].copy_(param.data.reshape(-1))
            param.data = self.param_data[start:end].view(param.shape)
            param.main_grad = self.grad_data[start:end].view(param.shape)
        self.buckets = [
            GradBucket(
                index,
                members,
                start,
                self.grad_data[start:end],
                self.param_data[start:end],
                group,
                scaling_factor,
                for_distributed_optimizer,
                instance_group,
            )
            for index, (start, end, members) in enumerate(bucket_layout)
        ]
        self._bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        self._next_to_launch = 0

    @property
    def params(self) -> list:
        return list(self._ranges)

    def param_range(self, param) -> tuple[int, int]:
        """``[start, end)`` of ``param`` in this buffer."""
        return self._ranges[param]

    def bucket_of(self, param) -> GradBucket:
        return self._bucket_of[param]

    def register_grad_ready(self, param) -> None:
        """Record that ``param``'s gradient is complete; launch every complete bucket whose
        predecessors were launched (buckets always launch in index order, so all replicas
        issue their collectives in the same order)."""
        bucket = self._bucket_of[param]
        if bucket.launched:
            raise GradSyncOrderError(
                f"a gradient of shape {tuple(param.shape)} arrived after its bucket's reduction was "
                "launched: run every micro-batch but the last inside no_sync(), and call "
                "zero_grad_buffer() before the next iteration"
            )
        bucket.mark_ready(param)
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].all_ready:
            self.buckets[self._next_to_launch].start_grad_sync()
            self._next_to_launch += 1

    def start_grad_sync(self) -> None:
        for bucket in self.buckets:
            bucket.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Launch every bucket not launched yet, then wait for all (the collectives of
        different buckets are in flight together)."""
        self.start_grad_sync()
        for bucket in self.buckets:
            bucket.finish_grad_sync()
        self._next_to_launch = 0

    def reset(self) -> None:
        """Zero the gradients and re-arm every bucket."""
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
        self._next_to_launch = 0

    def start_param_sync(self) -> None:
        """Launch every bucket's parameter gather, in the order the forward pass uses them
        (the reverse of the bucket order)."""
        for bucket in reversed(self.buckets):
            bucket.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter gather in flight."""
        for bucket in self.buckets:
            bucket.finish_param_sync()
