"""Settings of :class:`DistributedDataParallel`, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.errors import MegatronConfigError


class DistributedConfigError(MegatronConfigError):
    """An invalid data-parallel setting; the message names the field and what is accepted."""


def default_bucket_size(dp_cp_size: int) -> int:
    """Megatron's bucket size when none is given: 40M elements, or 1M per replica beyond 40."""
    return max(40_000_000, 1_000_000 * dp_cp_size)


@dataclass
class DistributedDataParallelConfig:
    """How gradients are buffered and reduced across the data-parallel replicas.

    grad_reduce_in_fp32: keep ``param.main_grad`` (and reduce it) in fp32 for bf16/fp16 params.
    grad_reduce_in_bf16: keep ``param.main_grad`` (and reduce it) in bf16 for every param: half
        the traffic and buffer memory; the optimizer's fp32 masters get fp32 copies of it.
    overlap_grad_reduce: launch a bucket's reduction from the backward hooks as soon as all
        of its gradients are ready, instead of waiting for ``finish_grad_sync``.
    overlap_param_gather: after the distributed optimizer's step, all-gather the updated
        parameters asynchronously, bucket by bucket, each waited on by the forward pre-hook of
        the first module that uses it (needs ``use_distributed_optimizer``).
    use_distributed_optimizer: reduce-scatter gradients (each replica keeps its 1/DP shard of
        every bucket) and keep parameters in a flat buffer so the optimizer can all-gather them.
    bucket_size: elements per bucket (a bucket closes after the param that reaches it); None
        takes :func:`default_bucket_size`. The layout does not depend on the overlap settings,
        so overlapped and non-overlapped runs shard and reduce identically.
    num_distributed_optimizer_instances: with the distributed optimizer, split each replica
        group into this many instances of consecutive ranks: the optimizer state is sharded
        within an instance, gradients are reduce-scattered within it and then all-reduced
        across the instances, parameters gathered within it (less traffic over the slow links
        between instances, more memory per rank).
    """

    grad_reduce_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None
    num_distributed_optimizer_instances: int = 1

    def __post_init__(self):
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise DistributedConfigError(
                f"bucket_size must be None (the default size) or an integer >= 1, got {self.bucket_size!r}"
            )
        if self.grad_reduce_in_fp32 and self.grad_reduce_in_bf16:
            raise DistributedConfigError("grad_reduce_in_fp32 and grad_reduce_in_bf16 are both set; choose one")
        instances = self.num_distributed_optimizer_instances
        if not isinstance(instances, int) or instances < 1:
            raise DistributedConfigError(
                f"num_distributed_optimizer_instances must be an integer >= 1, got {instances!r}"
            )
        if instances > 1 and not self.use_distributed_optimizer:
            raise DistributedConfigError(
                f"num_distributed_optimizer_instances {instances} needs use_distributed_optimizer (instances shard the "
                "optimizer state)"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise DistributedConfigError(
                "overlap_param_gather needs use_distributed_optimizer (only the distributed optimizer "
                "gathers parameters)"
            )
