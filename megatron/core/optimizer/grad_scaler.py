"""Loss scalers: a constant scale, or Megatron's dynamic scale for fp16 training.

The training loop multiplies the loss by ``scale``; the optimizer multiplies gradients by
``inv_scale`` and calls ``update(found_inf)`` once per step.
"""

from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflow (the step is still skipped by the optimizer)."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Scale that backs off on overflow and grows after a window of clean steps.

    Each step with inf/nan gradients resets the clean-step count and spends one unit of
    ``hysteresis``; when none is left the scale is multiplied by ``backoff_factor`` (never
    below ``min_scale``). After ``growth_interval`` consecutive clean steps the scale is
    multiplied by ``growth_factor`` and the hysteresis budget is refilled.
    """

    def __init__(
        self, initial_scale, min_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, hysteresis=2
    ):
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._clean_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
