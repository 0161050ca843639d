"""Several optimizers (modules or parameter sets with their own settings) stepped as one."""

from __future__ import annotations

import math

from megatron.core.optimizer.optimizer import step_optimizers
from megatron.core.optimizer.optimizer_config import OptimizerConfigError


class ChainedOptimizer:
    """Step, zero and checkpoint several optimizers together.

    The step takes one inf/nan decision and one global gradient norm (the root of the sum
    of the members' squared global norms) for all members, so that either every member
    steps, clipped by the same coefficient, or none does. Every rank must hold the same
    members in the same order. ``param_groups`` concatenates the members' groups (the same
    dicts, so an LR scheduler driving the chain drives each member).

    The loss is scaled once, so all members must unscale by the same scale: either no member
    has a loss scaler, or all have one and they are made to share the first member's.
    """

    def __init__(self, chained_optimizers: list):
        if not chained_optimizers:
            raise OptimizerConfigError("ChainedOptimizer needs at least one optimizer, got an empty list")
        self.chained_optimizers = list(chained_optimizers)
        with_scaler = [opt.grad_scaler is not None for opt in self.chained_optimizers]
        if any(with_scaler) and not all(with_scaler):
            raise OptimizerConfigError(
                f"chained optimizers disagree on loss scaling (member has a loss scaler: {with_scaler}); "
                "use the same fp16 / loss_scale settings for every member"
            )
        for opt in self.chained_optimizers[1:]:
            opt.grad_scaler = self.chained_optimizers[0].grad_scaler

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.chained_optimizers for group in opt.param_groups]

    @property
    def config(self):
        return self.chained_optimizers[0].config

    def get_loss_scale(self) -> float:
        """The shared loss scale (1.0 without loss scaling)."""
        return self.chained_optimizers[0].get_loss_scale()

    def scale_loss(self, loss):
        return loss * self.get_loss_scale()

    def step(self) -> tuple[bool, float | None, int | None]:
        """``(update_successful, grad_norm, num_zeros_in_grad)`` of the agreed step."""
        return step_optimizers(self.chained_optimizers)

    def params_norm(self) -> float:
        """Global L2 norm of every member's parameters (the root of their squared norms)."""
        return math.sqrt(sum(opt.params_norm() ** 2 for opt in self.chained_optimizers))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def reload_model_params(self) -> None:
        for opt in self.chained_optimizers:
            opt.reload_model_params()

    def state_dict(self) -> list[dict]:
        """One state dict per member, in member order."""
        return [opt.state_dict() for opt in self.chained_optimizers]

    def load_state_dict(self, state_dict: list[dict]) -> None:
        if len(state_dict) != len(self.chained_optimizers):
            raise OptimizerConfigError(
                f"chained optimizer state has {len(state_dict)} members but this chain has "
                f"{len(self.chained_optimizers)}; load a state saved from a chain of the same optimizers"
            )
        for opt, member_state in zip(self.chained_optimizers, state_dict, strict=True):
            opt.load_state_dict(member_state)
