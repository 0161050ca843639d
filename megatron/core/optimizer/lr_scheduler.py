"""Learning-rate and weight-decay schedule applied to an optimizer's param groups each iteration.

Linear warm-up from ``init_lr`` to ``max_lr`` over ``lr_warmup_iters``, then ``constant``,
``linear``, ``cosine`` or ``inverse-square-root`` decay towards ``min_lr``, reached at
``lr_decay_iters``; ``min_lr`` after that. Weight decay is constant. A param group may carry
``lr_mult`` / ``wd_mult`` (default 1.0), e.g. ``wd_mult=0.0`` for biases and norms, and
``is_decoupled_lr`` (the embeddings and the output layer): with ``decoupled_lr`` such groups
follow the same schedule between ``decoupled_lr`` and ``decoupled_min_lr`` (default ``min_lr``),
as Megatron's ``--decoupled-lr`` / ``--decoupled-min-lr``.
"""

from __future__ import annotations

import math
from typing import Any

from megatron.core.errors import MegatronConfigError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
ON_MISMATCH = ("error", "use_current", "use_checkpoint")
# Constructor argument -> command-line flag, for messages.
FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "init_lr": "--lr-warmup-init",
    "lr_warmup_iters": "--lr-warmup-iters",
    "lr_decay_iters": "--lr-decay-iters",
    "lr_decay_style": "--lr-decay-style",
    "weight_decay": "--weight-decay",
    "decoupled_lr": "--decoupled-lr",
    "decoupled_min_lr": "--decoupled-min-lr",
}
# Settings older checkpoints do not hold, with the value they ran with.
OPTIONAL_SETTINGS = {"decoupled_lr": None, "decoupled_min_lr": None}


class LRSchedulerConfigError(MegatronConfigError):
    """Schedule settings that disagree, or a checkpointed schedule that does not fit; the
    message names the flags at fault."""


def _flag(name: str, value: Any) -> str:
    return f"{FLAGS[name]} ({value})"


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every ``optimizer.param_groups`` entry.

    ``num_iters`` counts completed :meth:`step` calls; the value for iteration ``n`` is
    :meth:`get_lr` at ``num_iters = n``. Construction applies the values for ``num_iters = 0``.
    ``lr_warmup_iters`` / ``lr_decay_iters`` may be fractional (a schedule in samples of a
    constant global batch: samples / global batch size).
    ``optimizer`` is anything with a ``param_groups`` list of dicts.
    """

    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        lr_decay_iters: float,
        min_lr: float = 0.0,
        init_lr: float = 0.0,
        lr_warmup_iters: float = 0,
        lr_decay_style: str = "linear",
        weight_decay: float = 0.0,
        decoupled_lr: float | None = None,
        decoupled_min_lr: float | None = None,
    ):
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        # Fractional when the schedule is given in samples (--lr-warmup-samples etc.).
        self.lr_warmup_iters = lr_warmup_iters
        self.lr_decay_iters = lr_decay_iters
        self.lr_decay_style = lr_decay_style
        self.weight_decay = float(weight_decay)
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)
        self.decoupled_min_lr = None if decoupled_min_lr is None else float(decoupled_min_lr)
        self._validate()
        self.num_iters = 0
        self.step(0)

    def _validate(self) -> None:
        for name in ("max_lr", "min_lr", "init_lr", "weight_decay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise LRSchedulerConfigError(f"{_flag(name, value)} must be a finite number >= 0")
        if self.min_lr > self.max_lr:
            raise LRSchedulerConfigError(f"{_flag('min_lr', self.min_lr)} must be <= {_flag('max_lr', self.max_lr)}")
        for name in ("decoupled_lr", "decoupled_min_lr"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise LRSchedulerConfigError(f"{_flag(name, value)} must be a finite number >= 0")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise LRSchedulerConfigError(f"{_flag('decoupled_min_lr', self.decoupled_min_lr)} needs --decoupled-lr")
        if self.decoupled_lr is not None and self._decoupled_min_lr() > self.decoupled_lr:
            raise LRSchedulerConfigError(
                f"the decoupled minimum LR ({self._decoupled_min_lr()}) must be <= "
                f"{_flag('decoupled_lr', self.decoupled_lr)}"
            )
        if self.lr_warmup_iters < 0:
            raise LRSchedulerConfigError(f"{_flag('lr_warmup_iters', self.lr_warmup_iters)} must be >= 0")
        if self.lr_decay_iters < 1:
            raise LRSchedulerConfigError(f"{_flag('lr_decay_iters', self.lr_decay_iters)} must be >= 1")
        if self.lr_warmup_iters > self.lr_decay_iters:
            raise LRSchedulerConfigError(
                f"{_flag('lr_warmup_iters', self.lr_warmup_iters)} must be <= "
                f"{_flag('lr_decay_iters', self.lr_decay_iters)}"
            )
        if self.lr_decay_style not in DECAY_STYLES:
            raise LRSchedulerConfigError(
                f"--lr-decay-style {self.lr_decay_style!r} is unknown; accepted: {', '.join(DECAY_STYLES)}"
            )

    def _decoupled_min_lr(self) -> float:
        return self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr

    def get_lr(self, num_iters: int | None = None, decoupled: bool = False) -> float:
        """Learning rate after ``num_iters`` iterations (default: the current count); with
        ``decoupled`` (and ``decoupled_lr`` set) that of the decoupled groups."""
        n = self.num_iters if num_iters is None else num_iters
        max_lr, min_lr = self.max_lr, self.min_lr
        if decoupled and self.decoupled_lr is not None:
            max_lr, min_lr = self.decoupled_lr, self._decoupled_min_lr()
        warmup = self.lr_warmup_iters
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_iters:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1) / max(n, 1)))
        progress = (n - warmup) / (self.lr_decay_iters - warmup)
        if self.lr_decay_style == "linear":
            coefficient = 1.0 - progress
        else:  # cosine
            coefficient = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr + coefficient * (max_lr - min_lr)

    def get_wd(self) -> float:
        """Weight decay (constant over training)."""
        return self.weight_decay

    def step(self, increment: int = 1) -> None:
        """Advance ``increment`` iterations and write the new values into the param groups."""
        self.num_iters += increment
        lrs, wd = {False: self.get_lr(), True: self.get_lr(decoupled=True)}, self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lrs[bool(group.get("is_decoupled_lr", False))] * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def _schedule(self) -> dict:
        return {name: getattr(self, name) for name in FLAGS}

    def state_dict(self) -> dict:
        """The schedule settings and ``num_iters``, as plain JSON-able values."""
        return {**self._schedule(), "num_iters": self.num_iters}

    def load_state_dict(self, state_dict: dict, on_mismatch: str = "error") -> None:
        """Resume from :meth:`state_dict` output: restores ``num_iters`` and re-applies the values.

        When the checkpoint's settings differ from this scheduler's, ``on_mismatch`` decides:
        ``"error"`` raises, naming the flags; ``"use_current"`` keeps this scheduler's settings
        (Megatron's ``--override-opt-param-scheduler``); ``"use_checkpoint"`` takes the
        checkpoint's (``--use-checkpoint-opt-param-scheduler``).
        """
        if on_mismatch not in ON_MISMATCH:
            raise LRSchedulerConfigError(f"on_mismatch {on_mismatch!r} is unknown; accepted: {', '.join(ON_MISMATCH)}")
        state_dict = {**OPTIONAL_SETTINGS, **state_dict}
        missing = sorted((set(FLAGS) | {"num_iters"}) - set(state_dict))
        if missing:
            raise LRSchedulerConfigError(f"LR scheduler state is missing {', '.join(missing)}")
        differing = [name for name in FLAGS if state_dict[name] != getattr(self, name)]
        if differing and on_mismatch == "error":
            details = ", ".join(
                f"{FLAGS[name]} {getattr(self, name)} (checkpoint: {state_dict[name]})" for name in differing
            )
            raise LRSchedulerConfigError(
                f"the checkpoint's LR schedule differs from the arguments: {details}; pass "
                "--override-opt-param-scheduler to keep the arguments or "
                "--use-checkpoint-opt-param-scheduler to take the checkpoint's"
            )
        if on_mismatch == "use_checkpoint":
            previous = self._schedule()
            for name in FLAGS:
                setattr(self, name, state_dict[name])
            try:
                self._validate()
            except LRSchedulerConfigError:
                for name, value in previous.items():
                    setattr(self, name, value)
                raise
        num_iters = state_dict["num_iters"]  # fractional under a batch-size schedule
        self.num_iters = int(num_iters) if num_iters == int(num_iters) else float(num_iters)
        self.step(0)
