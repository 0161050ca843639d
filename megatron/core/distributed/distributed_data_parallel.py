"""Data-parallel wrapper: contiguous gradient buffers reduced over the replica group.

Scaling chain (mean loss; every gradient must end as the mean over all ``dp_cp_gtp`` data
shards, N = |dp_cp| * G of them, each rank having back-propagated the mean loss of its own
micro-batch):

1. GTP-sharded weights: the layer's reduce-scatter over ``gtp`` sums the G peers' gradients
   and multiplies by 1/G, leaving each peer the mean over its GTP group for its shard.
2. Replicated params (norms, biases, Mamba scalars): ``finalize_model_grads`` all-reduces
   their gradients over ``gtp`` as a mean (x 1/G), the same factor.
3. This wrapper multiplies every gradient by 1/|dp_cp| and sums it over ``dp_cp`` (the
   GTP-excluded replica group): 1/G * 1/|dp_cp| = 1/N.

Expert parameters (``is_expert``) live in buffers of their own, reduced over ``expt_dp``
with the same factor 1/|dp_cp| (Megatron's choice): the MoE layer's backward already gives
each expert the sum over the tokens its EP peers dispatched to it, and expert-DP x EP x ETP
spans the same TP x CP x DP ranks as the dense domain.

Steps 2 and 3 are linear and act on the same ``main_grad`` so their order does not matter.
With ``config.calculate_per_token_loss`` every step sums instead (factor 1), and the
training loop divides by the token count gathered over ``dp_cp_gtp`` (see
:meth:`DistributedDataParallel.scale_gradients`).

Overlap. Buckets hold parameters in reverse creation order, so the first bucket's gradients
are complete early in backward. With ``overlap_grad_reduce`` the gradient-accumulator hook of
each parameter marks it ready and the buffer launches every complete bucket's collective
(asynchronously, in bucket order on every replica) while backward goes on;
:meth:`DistributedDataParallel.finish_grad_sync` only waits. With ``overlap_param_gather`` the
distributed optimizer launches the parameter all-gathers after its step and a forward pre-hook
on each module waits for the buckets of that module's own parameters. The bucket layout and
the arithmetic are the same with and without overlap, so results are identical. With one
replica there is nothing to communicate and neither kind of hook is installed.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
    default_bucket_size,
)
from megatron.core.distributed.main_grad import is_main_grad_placeholder
from megatron.core.distributed.param_and_grad_buffer import GradBucket, ParamAndGradBuffer, split_into_instances
from megatron.core.parallel_state import resolve_pg_collection


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so its gradients accumulate in flat buffers (``param.main_grad``) and are
    averaged over the ``dp_cp`` replica group (``expt_dp`` for expert parameters).

    Per iteration: run forward/backward for each micro-batch (all but the last inside
    :meth:`no_sync`), then :meth:`finish_grad_sync`, the optimizer step, and
    :meth:`zero_grad_buffer`. ``param.grad`` stays None: the backward hook adds each gradient
    to ``main_grad`` (unless a linear layer's wgrad GEMM already accumulated into it: gradient
    accumulation fusion, :mod:`megatron.core.distributed.main_grad`). With
    ``overlap_param_gather``, parameters are complete inside a forward pass; read them elsewhere
    (saving, comparing) after :meth:`finish_param_sync`. Move and cast the module before wrapping
    it: the hooks sit on each parameter's gradient accumulator, which a change of a parameter's
    device or dtype replaces (as in Megatron).
    """

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module, pg_collection=None):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.dp_cp_group = self.pg_collection.dp_cp
        self.expert_dp_group = self.pg_collection.expert_dp_group()
        dp_cp_size = dist.get_world_size(self.dp_cp_group)
        # Megatron's factor for both domains: an expert's gradient after backward already sums
        # the tokens its EP peers dispatched to it, so expert-DP sums the rest of the data shards.
        scaling_factor = 1.0 if config.calculate_per_token_loss else 1.0 / dp_cp_size
        # Reverse creation order approximates the order in which backward produces gradients.
        params = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        by_kind: dict[tuple[bool, torch.dtype, torch.dtype], list] = {}
        for param in params:
            kind = (bool(getattr(param, "is_expert", False)), param.dtype, self._grad_dtype(param))
            by_kind.setdefault(kind, []).append(param)
        self.param_and_grad_buffers = []
        self._reducing_in_backward: set[ParamAndGradBuffer] = set()
        instances = ddp_config.num_distributed_optimizer_instances
        split = {
            kind: split_into_instances(group, instances)
            for kind, group in ((False, self.dp_cp_group), (True, self.expert_dp_group))
        }
        for (is_expert, _, grad_dtype), members in by_kind.items():
            group, instance_group = split[is_expert]
            replicas = dist.get_world_size(group)
            buffer = ParamAndGradBuffer(
                members,
                grad_dtype,
                group,
                scaling_factor,
                ddp_config.bucket_size or default_bucket_size(replicas),
                ddp_config.use_distributed_optimizer,
                overlap_param_gather=ddp_config.overlap_param_gather and replicas > 1,
                instance_group=instance_group,
            )
            self.param_and_grad_buffers.append(buffer)
            if ddp_config.overlap_grad_reduce and replicas > 1:
                self._reducing_in_backward.add(buffer)
        self._buffer_of = {p: buf for buf in self.param_and_grad_buffers for p in buf.params}
        self._sync_enabled = True
        self._grad_accumulators = []
        with torch.enable_grad():
            for param in params:
                # The hook sits on the parameter's gradient accumulator node, before it runs: it
                # sees the sum of the unfused contributions and fires once per backward even when
                # every contribution went into main_grad by fusion (see main_grad.py). The node
                # lives while a reference to it does: keep one.
                accumulator = param.view_as(param).grad_fn.next_functions[0][0]
                accumulator.register_prehook(partial(self._accumulate_into_main_grad, param))
                self._grad_accumulators.append(accumulator)
        if any(buffer.overlap_param_gather for buffer in self.param_and_grad_buffers):
            self._register_param_gather_hooks()

    def _grad_dtype(self, param) -> torch.dtype:
        if self.ddp_config.grad_reduce_in_bf16:
            return torch.bfloat16
        return torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param.dtype

    def _accumulate_into_main_grad(self, param, grads: tuple) -> tuple:
        """Add this backward's gradient of ``param`` to its ``main_grad`` (nothing to add where the
        layers' fusion already did) and mark it ready; ``param.grad`` is never set."""
        (grad,) = grads
        if grad is not None and not is_main_grad_placeholder(grad):
            param.main_grad.add_(grad)
        buffer = self._buffer_of[param]
        if self._sync_enabled and buffer in self._reducing_in_backward:
            buffer.register_grad_ready(param)
        return (None,)

    def _register_param_gather_hooks(self) -> None:
        """Before a module runs, wait for the gathers of the buckets holding its own parameters
        (and before the model runs, those of the tied embeddings)."""
        for submodule in self.module.modules():
            buckets: list[GradBucket] = []
            for param in submodule.parameters(recurse=False):
                buffer = self._buffer_of.get(param)
                bucket = buffer.bucket_of(param) if buffer is not None and buffer.overlap_param_gather else None
                if bucket is not None and bucket not in buckets:
                    buckets.append(bucket)
            if buckets:
                submodule.register_forward_pre_hook(partial(_finish_param_sync, buckets))
        # A tied embedding is read by the last stage's output layer while its own module never
        # runs there: its gathers finish before the whole model's forward.
        shared = []
        for param in self.module.parameters():
            buffer = self._buffer_of.get(param)
            if getattr(param, "shared_embedding", False) and buffer is not None and buffer.overlap_param_gather:
                bucket = buffer.bucket_of(param)
                if bucket not in shared:
                    shared.append(bucket)
        if shared:
            self.module.register_forward_pre_hook(partial(_finish_param_sync, shared))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no reduction is launched) for the enclosed backward passes."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not launched yet (asynchronously)."""
        for buffer in self.param_and_grad_buffers:
            buffer.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction; afterwards ``main_grad`` holds the averaged
        gradient (with the distributed optimizer: at least on this replica's shard)."""
        for buffer in self.param_and_grad_buffers:
            buffer.finish_grad_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter gather still in flight (before reading all parameters
        outside a forward pass, e.g. to save them)."""
        for buffer in self.param_and_grad_buffers:
            buffer.finish_param_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` and re-arm the buckets for the next iteration."""
        for param in self._buffer_of:
            param.grad = None
        for buffer in self.param_and_grad_buffers:
            buffer.reset()

    def scale_gradients(self, factor: float) -> None:
        """Multiply every ``main_grad`` by ``factor`` (e.g. 1 / total tokens for per-token loss)."""
        for buffer in self.param_and_grad_buffers:
            buffer.grad_data.mul_(factor)

    def broadcast_params(self) -> None:
        """Copy the parameters of the first replica to every other replica (``dp_cp`` for
        dense parameters, ``expt_dp`` for expert parameters)."""
        for param in self.module.parameters():
            group = self.expert_dp_group if getattr(param, "is_expert", False) else self.dp_cp_group
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no ``module.`` prefix), after pending gathers."""
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


def _finish_param_sync(buckets: list[GradBucket], module, args) -> None:
    for bucket in buckets:
        bucket.finish_param_sync()
