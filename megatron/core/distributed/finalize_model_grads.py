"""Last gradient reductions after backward, before the optimizer step.

Data-parallel reduction belongs to DDP (``finish_grad_sync`` on each module that has it); this
module adds the reductions that model parallelism needs on top:

* parameters replicated across GTP peers (``gtp_sharded`` False: norms, biases, Mamba scalars)
  are all-reduced over ``gtp``, averaged for mean losses and summed under
  ``config.calculate_per_token_loss`` (GTP-sharded weights were already reduce-scattered in
  backward);
* parameters tagged ``sequence_parallel`` are summed over ``tp`` (each TP rank saw only its
  sequence chunk);
* weights tagged ``shared_embedding`` (input embedding and output layer tied across the first
  and last pipeline stage) are summed over ``embd``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron.core.parallel_state import resolve_pg_collection


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    """The gradient DDP keeps (``main_grad``) or autograd's; a missing one becomes zeros so that
    every rank joins the same collectives with the same shapes."""
    grad = getattr(param, "main_grad", None)
    if grad is not None:
        return grad
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group, scale: float = 1.0) -> None:
    """Sum ``grads`` over ``group`` in place (one flat buffer per dtype), then multiply by ``scale``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype in sorted(by_dtype, key=str):
        same = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for grad in same:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _unique_trainable_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    seen, params = set(), []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def finalize_model_grads(modules, pg_collection=None, config=None) -> None:
    """Finish gradient reductions of ``modules`` (a module or a list of model chunks).

    Args:
        modules: the model chunks of this rank; each chunk's ``finish_grad_sync()`` (DDP) is
            called first when it has one.
        pg_collection: the groups to reduce over (None: the global collection).
        config: gives ``calculate_per_token_loss``; None takes the first chunk's ``config``.
    """
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    pg = resolve_pg_collection(pg_collection)
    if config is None:
        config = getattr(modules[0], "config", None)
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    for module in modules:
        if hasattr(module, "finish_grad_sync"):
            module.finish_grad_sync()
    params = _unique_trainable_params(modules)

    gtp_size = pg.size("gtp")
    if gtp_size > 1:
        replicated = [_grad_of(p) for p in params if not getattr(p, "gtp_sharded", False)]
        if replicated:
            _all_reduce_coalesced(replicated, pg.gtp, 1.0 if per_token else 1.0 / gtp_size)

    if pg.size("tp") > 1:
        sequence_parallel = [_grad_of(p) for p in params if getattr(p, "sequence_parallel", False)]
        if sequence_parallel:
            _all_reduce_coalesced(sequence_parallel, pg.tp)

    if pg.size("pp") > 1 and pg.has("embd") and pg.size("embd") > 1:
        tied = [_grad_of(p) for p in params if getattr(p, "shared_embedding", False)]
        if tied:
            _all_reduce_coalesced(tied, pg.embd)
