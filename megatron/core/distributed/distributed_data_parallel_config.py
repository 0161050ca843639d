"""Settings of :class:`DistributedDataParallel`, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.errors import MegatronConfigError


class DistributedConfigError(MegatronConfigError):
    """An invalid data-parallel setting; the message names the field and what is accepted."""


@dataclass
class DistributedDataParallelConfig:
    """How gradients are buffered and reduced across the data-parallel replicas.

    grad_reduce_in_fp32: keep ``param.main_grad`` (and reduce it) in fp32 for bf16/fp16 params.
    overlap_grad_reduce: launch a bucket's reduction from the backward hooks as soon as all
        of its gradients are ready, instead of waiting for ``finish_grad_sync``.
    use_distributed_optimizer: reduce-scatter gradients (each replica keeps its 1/DP shard of
        every bucket) and keep parameters in a flat buffer so the optimizer can all-gather them.
    bucket_size: elements per bucket (a bucket closes after the param that reaches it);
        None puts each buffer in one bucket.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None

    def __post_init__(self):
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise DistributedConfigError(
                f"bucket_size must be None (one bucket) or an integer >= 1, got {self.bucket_size!r}"
            )
