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
  and last pipeline stage) are summed over ``embd``;
* with per-token loss (``num_tokens`` given: the loss was a sum), every gradient is divided
  by the global batch's token count: the last stage's counts summed over ``dp_cp_gtp`` and
  sent to the other stages, as Megatron does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.tensor_parallel.collectives import all_reduce_coalesced


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    """The gradient DDP keeps (``main_grad``) or autograd's; a missing one becomes zeros so that
    every rank joins the same collectives with the same shapes."""
    grad = getattr(param, "main_grad", None)
    if grad is not None:
        return grad
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _unique_trainable_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    seen, params = set(), []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def global_token_count(num_tokens: torch.Tensor, pg) -> torch.Tensor:
    """The global batch's token count on every rank, from each last-stage rank's count
    (``num_tokens``; other stages pass anything): summed over ``dp_cp_gtp``, broadcast over ``pp``."""
    count = num_tokens.detach().to(torch.float64).clone()
    if pg.size("pp") > 1:
        last = dist.get_global_rank(pg.pp, pg.size("pp") - 1)
        dist.broadcast(count, src=last, group=pg.pp)
    dist.all_reduce(count, group=pg.dp_cp_gtp_or_dp_cp())
    return count


def finalize_model_grads(modules, pg_collection=None, config=None, num_tokens: torch.Tensor | None = None) -> None:
    """Finish gradient reductions of ``modules`` (a module or a list of model chunks).

    Args:
        modules: the model chunks of this rank; each chunk's ``finish_grad_sync()`` (DDP) is
            called first when it has one.
        pg_collection: the groups to reduce over (None: the global collection).
        config: gives ``calculate_per_token_loss``; None takes the first chunk's ``config``.
        num_tokens: with per-token loss, this rank's token count of the iteration (meaningful on
            the last pipeline stage): the gradients are divided by the global count.
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
            all_reduce_coalesced(replicated, pg.gtp, 1.0 if per_token else 1.0 / gtp_size)

    if pg.size("tp") > 1:
        sequence_parallel = [_grad_of(p) for p in params if getattr(p, "sequence_parallel", False)]
        if sequence_parallel:
            all_reduce_coalesced(sequence_parallel, pg.tp)

    if pg.size("pp") > 1 and pg.has("embd") and pg.size("embd") > 1:
        tied = [_grad_of(p) for p in params if getattr(p, "shared_embedding", False)]
        if tied:
            all_reduce_coalesced(tied, pg.embd)

    if num_tokens is not None:
        scale = 1.0 / max(global_token_count(num_tokens, pg).item(), 1.0)
        for module in modules:
            if hasattr(module, "scale_gradients"):
                module.scale_gradients(scale)
        for param in params:
            if getattr(param, "main_grad", None) is None and param.grad is not None:
                param.grad.mul_(scale)
