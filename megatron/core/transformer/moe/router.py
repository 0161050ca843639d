"""Top-k router: scores, expert choice, capacity, and the auxiliary losses.

Megatron's semantics: ``softmax`` scores take the top-k of the logits and softmax over the k
chosen (``pre_softmax``: softmax over all experts first, the k chosen probabilities unnormalized);
``sigmoid`` scores take the top-k of ``sigmoid(logits)`` and normalize the k chosen to sum to one.
With an expert bias (aux-loss-free balancing) the bias shifts only the choice, never the weights.
``sinkhorn`` load balancing chooses experts by Sinkhorn-balanced scores in training instead of
adding a loss (see :meth:`TopKRouter._sinkhorn_scores`).

The load-balancing loss and the z-loss join the training loss through
:class:`MoEAuxLossAutoScaler`: the forward returns the routing weights untouched, the backward
adds the loss's gradient, so no caller has to carry the loss to the criterion.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.inference.kernels import invariant_linear, is_batch_invariant
from megatron.core.transformer.init_methods import init_method


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; its backward seeds ``aux_loss`` with ``main_loss_backward_scale``.

    Set the scale (e.g. to ``1 / num_microbatches``) when the main loss is scaled the same way.
    """

    main_loss_backward_scale: float = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, MoEAuxLossAutoScaler.main_loss_backward_scale)


def load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """Megatron's ``aux_loss``: ``E * coeff / (k T^2) * sum_e P_e N_e`` with ``P_e`` the summed
    (normalized) scores of expert ``e`` over the ``T`` tokens and ``N_e`` the tokens routed to it."""
    num_tokens, num_experts = scores.shape
    tokens_per_expert = routing_map.sum(0).to(scores.dtype)
    return (scores.sum(0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * num_tokens * num_tokens))


def sequence_load_balancing_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, seq_length: int, topk: int, coeff: float
) -> torch.Tensor:
    """Megatron's ``seq_aux_loss``: the ``aux_loss`` of each sequence (tokens ``[s, b]`` flattened
    s-major), averaged over the batch."""
    num_experts = scores.shape[-1]
    scores = scores.view(seq_length, -1, num_experts)
    fraction = routing_map.view(seq_length, -1, num_experts).sum(0).to(scores.dtype) * (
        num_experts / (seq_length * topk)
    )
    return (fraction * scores.mean(0)).sum(-1).mean() * coeff


def sinkhorn_balance(logits: torch.Tensor, tol: float = 1e-4, max_iterations: int = 1000) -> torch.Tensor:
    """Sinkhorn-Knopp scaling of ``exp(logits)`` [T, E]: row factors and column factors are
    updated in turn until the column factors change by at most ``tol`` (mean absolute change),
    giving a matrix whose rows each sum to about ``1/T`` and whose columns each sum to ``1/E``.
    The logits' maximum is subtracted first (the result does not depend on it, and ``exp``
    cannot overflow)."""
    kernel = torch.exp(logits.float() - logits.float().max())
    tokens, experts = kernel.shape
    eps = 1e-8
    cols = kernel.new_ones(experts)
    for _ in range(max_iterations):
        rows = 1.0 / (tokens * ((kernel * cols).sum(1) + eps))
        new_cols = 1.0 / (experts * ((rows.unsqueeze(1) * kernel).sum(0) + eps))
        change = (new_cols - cols).abs().mean()
        cols = new_cols
        if not change > tol:  # converged (or not a number: nothing more to gain)
            break
    return rows.unsqueeze(1) * kernel * cols


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean(logsumexp(logits)^2)`` (ST-MoE), keeps router logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert keeps at most: ``ceil(T * k / E * capacity_factor)``."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


class TopKRouter(nn.Module):
    """``forward(hidden [T, h], seq_length=None) -> (probs [T, k], expert_of_slot [T, k])``.

    ``expert_of_slot`` holds the global ids of each token's chosen experts, ``num_experts`` for
    a slot dropped by the capacity factor (none when dropless); ``probs`` the weight of each slot
    (fp32, zero where dropped). ``seq_length`` (tokens ``[s, b]`` flattened) is for ``seq_aux_loss``.
    The last step's losses (detached) are in :attr:`aux_losses`; training passes also add each
    loss divided by its coefficient to :attr:`tracked_losses` (over :attr:`tracked_passes`
    passes) for :func:`aux_loss_metrics`, and the tokens routed per expert accumulate in
    ``local_tokens_per_expert`` for the bias update.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        if config.perform_initialization:
            init_method(config)(self.weight.data)
        else:
            nn.init.zeros_(self.weight)
        self.weight.data = self.weight.data.to(config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32), persistent=False
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.tracked_losses: dict[str, torch.Tensor] = {}
        self.tracked_passes = 0

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [T, k], indices [T, k], normalized scores of every expert [T, E])`` for the
        expert choice and the load-balancing loss."""
        config, bias = self.config, self.expert_bias
        if config.moe_router_load_balancing_type == "sinkhorn":
            return self._sinkhorn_scores(logits)
        if config.moe_router_score_function == "sigmoid":
            all_scores = torch.sigmoid(logits)
            indices = self._choose(all_scores if bias is None else all_scores + bias)
            probs = all_scores.gather(-1, indices)
            if self.topk > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
            normalized = all_scores / (all_scores.sum(-1, keepdim=True) + 1e-20)
        else:
            normalized = torch.softmax(logits, dim=-1)
            if config.moe_router_pre_softmax or bias is not None or config.moe_router_num_groups:
                indices = self._choose(normalized if bias is None else normalized + bias)
                probs = normalized.gather(-1, indices)
            else:
                values, indices = logits.topk(self.topk, dim=-1)
                probs = torch.softmax(values, dim=-1)
        if config.moe_router_topk_scaling_factor is not None:
            probs = probs * config.moe_router_topk_scaling_factor
        return probs, indices, normalized

    def _sinkhorn_scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Megatron's ``sinkhorn`` balancing: the weights are ``sigmoid`` (top-1) or ``softmax``
        (top-k) of the logits, taken at the chosen experts; a training pass chooses by the
        Sinkhorn-balanced scores (:func:`sinkhorn_balance`: every expert gets an equal share of
        the tokens' mass), an evaluation by the weights themselves."""
        weights = torch.sigmoid(logits) if self.topk == 1 else torch.softmax(logits, dim=-1)
        with torch.no_grad():
            choice = sinkhorn_balance(logits) if self.training else weights
            indices = choice.topk(self.topk, dim=-1).indices
        return weights.gather(-1, indices), indices, weights

    def _choose(self, choice: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids by ``choice [T, E]``; with groups, only experts of the
        ``moe_router_group_topk`` groups whose two best scores sum highest compete."""
        groups = self.config.moe_router_num_groups
        if groups:
            per_group = choice.view(choice.shape[0], groups, -1)
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
            best_groups = group_score.topk(self.config.moe_router_group_topk, dim=-1).indices
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, best_groups, True)
            choice = per_group.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view_as(choice)
        return choice.topk(self.topk, dim=-1).indices

    def forward(self, hidden_states: torch.Tensor, seq_length: int | None = None):
        config = self.config
        linear = invariant_linear if is_batch_invariant() else torch.nn.functional.linear
        logits = linear(hidden_states.float(), self.weight.float())
        losses = {}
        if config.moe_z_loss_coeff:
            losses["z_loss"] = z_loss(logits, config.moe_z_loss_coeff)
        probs, indices, all_scores = self.scores(logits)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, indices, True)
        expert_of_slot = indices
        if config.moe_expert_capacity_factor is not None:
            keep = self._within_capacity(probs, indices, routing_map)
            probs = probs * keep
            expert_of_slot = indices.masked_fill(~keep, self.num_experts)
        if self.training and config.moe_aux_loss_coeff:
            kind = config.moe_router_load_balancing_type
            if kind == "aux_loss":
                losses["load_balancing_loss"] = load_balancing_loss(
                    all_scores, routing_map, self.topk, config.moe_aux_loss_coeff
                )
            elif kind == "seq_aux_loss":
                losses["load_balancing_loss"] = sequence_load_balancing_loss(
                    all_scores, routing_map, seq_length or logits.shape[0], self.topk, config.moe_aux_loss_coeff
                )
        if self.training and self.local_tokens_per_expert is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(0).float()
        self.aux_losses = {name: loss.detach() for name, loss in losses.items()}
        if self.training and losses:
            self._track(losses)
        if self.training and losses and torch.is_grad_enabled():
            probs = MoEAuxLossAutoScaler.apply(probs, sum(losses.values()))
        return probs, expert_of_slot

    @torch.no_grad()
    def _track(self, losses: dict[str, torch.Tensor]) -> None:
        coeffs = {"load_balancing_loss": self.config.moe_aux_loss_coeff, "z_loss": self.config.moe_z_loss_coeff}
        for name, loss in losses.items():
            unscaled = loss.detach().float() / coeffs[name]
            self.tracked_losses[name] = self.tracked_losses.get(name, 0.0) + unscaled
        self.tracked_passes += 1

    def _within_capacity(self, probs, indices, routing_map) -> torch.Tensor:
        """Slots kept under the capacity factor: each expert keeps its highest-probability tokens."""
        num_tokens = routing_map.shape[0]
        capacity = min(
            num_tokens,
            expert_capacity(num_tokens, self.num_experts, self.topk, self.config.moe_expert_capacity_factor),
        )
        dense = torch.zeros_like(routing_map, dtype=probs.dtype).scatter_(-1, indices, probs.detach())
        dense = dense.masked_fill(~routing_map, -1.0)
        top_tokens = dense.topk(capacity, dim=0).indices  # [capacity, E]
        kept = torch.zeros_like(routing_map).scatter_(0, top_tokens, True) & routing_map
        return kept.gather(-1, indices)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean load - load)``, then reset the
        counts. ``tokens_per_expert`` overrides the local counts (e.g. summed over data parallel)."""
        counts = self.local_tokens_per_expert if tokens_per_expert is None else tokens_per_expert
        self.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(counts.mean() - counts)
        self.local_tokens_per_expert.zero_()


def set_aux_loss_scale(loss_scale: float, num_microbatches: int, per_token_loss: bool) -> None:
    """Seed the routers' auxiliary losses as the main loss is scaled (Megatron's rule): by the
    loss scale, and by ``1 / num_microbatches`` unless the loss is a per-token sum."""
    MoEAuxLossAutoScaler.main_loss_backward_scale = loss_scale / (1 if per_token_loss else num_microbatches)


@torch.no_grad()
def update_expert_biases(modules, groups: list) -> None:
    """One aux-loss-free balancing step of every router with an expert bias in ``modules``, from
    its token counts summed over ``groups`` (every rank that routed other tokens: data, context,
    sequence-parallel ranks), so that replicas keep identical biases. Ranks that routed the same
    tokens add identical counts, which the sign of the update does not see."""
    routers = [m for module in modules for m in module.modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    counts = torch.stack([router.local_tokens_per_expert for router in routers])
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    for router, router_counts in zip(routers, counts, strict=True):
        router.update_expert_bias(router_counts)


AUX_LOSS_NAMES = ("load_balancing_loss", "z_loss")


@torch.no_grad()
def aux_loss_metrics(modules, layer_group=None, replica_groups=()) -> dict[str, float]:
    """Megatron's MoE loss logging: each router's tracked losses (divided by their coefficients)
    averaged over its training passes since the last call (micro-batches and iterations), then
    over the MoE layers (summed over ``layer_group``, e.g. the pipeline stages, which hold other
    layers) and over ``replica_groups`` (ranks that routed other tokens: data, TP/sequence
    ranks). Resets the routers' tracking. Every rank of those groups must call it."""
    groups = [g for g in (layer_group, *replica_groups) if g is not None and dist.get_world_size(g) > 1]
    nccl = any(dist.get_backend(g) == "nccl" for g in groups)
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    totals = torch.zeros(2, len(AUX_LOSS_NAMES), dtype=torch.float64, device=device)  # [value sum, layers]
    for router in (m for module in modules for m in module.modules() if isinstance(m, TopKRouter)):
        for i, name in enumerate(AUX_LOSS_NAMES):
            if name in router.tracked_losses:
                totals[0, i] += float(router.tracked_losses[name]) / router.tracked_passes
                totals[1, i] += 1
        router.tracked_losses, router.tracked_passes = {}, 0
    if layer_group in groups:
        dist.all_reduce(totals, group=layer_group)
    values, replicas = totals[0].clone(), 1
    for group in groups:
        if group is not layer_group:
            dist.all_reduce(values, group=group)
            replicas *= dist.get_world_size(group)
    return {
        name: value / (layers * replicas)
        for name, value, layers in zip(AUX_LOSS_NAMES, values.tolist(), totals[1].tolist(), strict=True)
        if layers
    }
