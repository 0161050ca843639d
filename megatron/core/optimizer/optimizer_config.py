"""Optimizer settings (Megatron names), validated once."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.errors import MegatronConfigError

OPTIMIZERS = ("adam", "sgd", "muon")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "aol")
MUON_TP_MODES = ("duplicated", "distributed", "blockwise")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high")


class OptimizerConfigError(MegatronConfigError):
    """An invalid optimizer setting or model/optimizer combination; the message names the field."""


@dataclass
class OptimizerConfig:
    """Settings of :func:`megatron.core.optimizer.get_megatron_optimizer`.

    ``adam`` is AdamW (decoupled weight decay), as in Megatron. ``muon`` steps the weight
    matrices with Muon (:mod:`megatron.core.optimizer.muon`, the ``muon_*`` fields) and every
    other parameter (embeddings, output layer, norms, biases) with AdamW. Parameters whose dtype is not
    fp32 get fp32 master copies that the optimizer steps; ``bf16``/``fp16`` describe the model
    and ``fp16`` turns on dynamic loss scaling unless ``loss_scale`` fixes the scale.
    ``min_lr`` is read by the LR scheduler. ``clip_grad`` 0 disables clipping (the global
    gradient norm is still computed and reported).
    """

    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    log_num_zeros_in_grad: bool = False
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_num_ns_steps: int = 5
    muon_coefficient_type: str = "quintic"
    muon_tp_mode: str = "duplicated"
    muon_fp32_matmul_prec: str = "medium"

    def __post_init__(self):
        checks = [
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"),
            (self.lr is not None and self.lr >= 0, f"lr must be set to a number >= 0, got {self.lr!r}"),
            (self.min_lr >= 0, f"min_lr must be >= 0, got {self.min_lr!r}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay!r}"),
            (0 <= self.adam_beta1 < 1, f"adam_beta1 must be in [0, 1), got {self.adam_beta1!r}"),
            (0 <= self.adam_beta2 < 1, f"adam_beta2 must be in [0, 1), got {self.adam_beta2!r}"),
            (self.adam_eps > 0, f"adam_eps must be > 0, got {self.adam_eps!r}"),
            (self.sgd_momentum >= 0, f"sgd_momentum must be >= 0, got {self.sgd_momentum!r}"),
            (self.clip_grad >= 0, f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad!r}"),
            (not (self.bf16 and self.fp16), "bf16 and fp16 are both set; choose one"),
            (
                self.loss_scale is None or self.loss_scale > 0,
                f"loss_scale must be None (dynamic for fp16) or > 0, got {self.loss_scale!r}",
            ),
            (self.initial_loss_scale > 0, f"initial_loss_scale must be > 0, got {self.initial_loss_scale!r}"),
            (self.min_loss_scale > 0, f"min_loss_scale must be > 0, got {self.min_loss_scale!r}"),
            (
                isinstance(self.loss_scale_window, int) and self.loss_scale_window >= 1,
                f"loss_scale_window must be an integer >= 1, got {self.loss_scale_window!r}",
            ),
            (
                isinstance(self.hysteresis, int) and self.hysteresis >= 1,
                f"hysteresis must be an integer >= 1, got {self.hysteresis!r}",
            ),
            (0 <= self.muon_momentum < 1, f"muon_momentum must be in [0, 1), got {self.muon_momentum!r}"),
            (
                self.muon_scale_mode in MUON_SCALE_MODES,
                f"muon_scale_mode must be one of {', '.join(MUON_SCALE_MODES)}, got {self.muon_scale_mode!r}",
            ),
            (
                self.muon_coefficient_type in MUON_COEFFICIENT_TYPES,
                f"muon_coefficient_type must be one of {', '.join(MUON_COEFFICIENT_TYPES)}, "
                f"got {self.muon_coefficient_type!r}",
            ),
            (
                self.muon_tp_mode in MUON_TP_MODES,
                f"muon_tp_mode must be one of {', '.join(MUON_TP_MODES)}, got {self.muon_tp_mode!r}",
            ),
            (
                self.muon_fp32_matmul_prec in MUON_MATMUL_PRECISIONS,
                f"muon_fp32_matmul_prec must be one of {', '.join(MUON_MATMUL_PRECISIONS)}, "
                f"got {self.muon_fp32_matmul_prec!r}",
            ),
        ]
        if self.optimizer == "muon":
            from megatron.core.optimizer.muon import ns_coefficients  # the step-count rules live there

            try:
                ns_coefficients(self.muon_coefficient_type, self.muon_num_ns_steps)
            except ValueError as error:
                checks.append((False, str(error)))
        errors = [message for ok, message in checks if not ok]
        if errors:
            raise OptimizerConfigError("; ".join(errors))
