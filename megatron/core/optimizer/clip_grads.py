"""Global gradient statistics (norm, zero count, inf/nan) with every parameter counted once.

A gradient element exists on several ranks: TP/GTP peers hold copies of replicated params,
the last pipeline stage holds a copy of the tied embedding, DP replicas hold identical
gradients. The true global norm counts each element once:

* TP-sharded params (``tensor_model_parallel``) count on every TP rank (disjoint shards);
  others only on TP rank 0.
* GTP-sharded params (``gtp_sharded``) count on every GTP rank; replicated ones (norms,
  biases, Mamba scalars) only on GTP rank 0.
* Tied embedding copies (``shared_embedding``) count only on the first pipeline stage.
* The per-rank sums are added over ``mp`` (tp x gtp x pp), never over data-parallel replicas;
  a sharded optimizer, whose replicas hold disjoint pieces, adds over ``dp_cp`` as well.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def grad_counted_on_this_rank(param: torch.Tensor, pg_collection) -> bool:
    """Whether this rank's copy of ``param``'s gradient enters global statistics. An expert
    parameter not sharded over ``expt_tp`` (``tensor_model_parallel`` unset) is counted on
    expert-TP rank 0 only; its EP peers hold other experts and count theirs."""
    tp_group = "expt_tp" if getattr(param, "is_expert", False) and pg_collection.has("expt_tp") else "tp"
    if not getattr(param, "tensor_model_parallel", False) and pg_collection.rank(tp_group) != 0:
        return False
    if not getattr(param, "gtp_sharded", False) and pg_collection.rank("gtp") != 0:
        return False
    return not getattr(param, "shared_embedding", False) or pg_collection.rank("pp") == 0


def stats_device(group) -> torch.device:
    """Device for scalars reduced over ``group`` (CUDA under NCCL, else CPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(value: torch.Tensor, groups, op) -> torch.Tensor:
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=op, group=group)
    return value


def grad_norm_fp32(grads: list[torch.Tensor], sum_groups: list, device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients in the job, as a one-element fp32 tensor on ``device`` (no host
    sync): ``grads`` are this rank's (fp32) counted gradients; the squared sums are added over
    each group of ``sum_groups`` in turn. One multi-tensor norm for all gradients (no
    per-tensor launches)."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        total += torch.stack(torch._foreach_norm(grads)).square().sum().to(device)
    return _reduce(total, sum_groups, dist.ReduceOp.SUM).sqrt()


def root_sum_squares(norms: list) -> torch.Tensor | float:
    """``sqrt(a**2 + b**2 + ...)`` of floats or float64 tensors, summed left to right, so that
    the host's and the device's combination of partial norms give the same bits."""
    total = norms[0] * norms[0]
    for norm in norms[1:]:
        total = total + norm * norm
    return total.sqrt() if isinstance(total, torch.Tensor) else math.sqrt(total)


def count_zeros_fp32(grads: list[torch.Tensor], sum_groups: list, device: torch.device) -> int:
    """Number of zero elements among all counted gradients of the job."""
    total = torch.zeros(1, dtype=torch.int64, device=device)
    for grad in grads:
        total += (grad == 0).sum()
    return int(_reduce(total, sum_groups, dist.ReduceOp.SUM).item())


def unscale_and_find_nonfinite(
    grads: list[torch.Tensor], inv_scale: float, max_groups: list, device: torch.device
) -> bool:
    """Multiply ``grads`` (fp32, one device) by ``inv_scale`` in place and return whether any
    rank of the job (the union of ``max_groups``) has an inf or nan gradient: one multi-tensor
    kernel for the check and the unscale, one host sync for the decision."""
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        grad_device = grads[0].device
        found = torch.zeros(1, dtype=torch.float32, device=grad_device)
        scale = torch.full((1,), inv_scale, dtype=torch.float32, device=grad_device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale)
        flag += found.to(device)
    return bool(_reduce(flag, max_groups, dist.ReduceOp.MAX).item())


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """The factor that brings a global norm of ``total_norm`` down to ``max_norm`` (>= 1: no clipping)."""
    return max_norm / (total_norm + 1e-6)


def clip_grads_by_total_norm(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place so that a global norm of ``total_norm`` becomes at most ``max_norm``."""
    coefficient = clip_coefficient(max_norm, total_norm)
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)
