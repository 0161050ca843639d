"""Rotary position embeddings (RoPE), with optional Llama-3 frequency scaling and
position interpolation. Rotation uses the "rotate half" layout (first and second half of
the rotated channels pair up), as Megatron and HuggingFace Llama do; the rotation itself is
:func:`megatron.core.fusions.rope.apply_rotary_pos_emb` (fused into the QKV split in attention)."""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron.core.config import ConfigError
from megatron.core.fusions.rope import apply_rotary_pos_emb

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb", "llama3_scaled_inv_freq", "yarn_concentration", "yarn_inv_freq"]

# Llama-3.1 frequency scaling constants (Megatron's defaults).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Divide low frequencies by ``factor``, keep high ones, interpolate in between."""
    low_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    smooth = (LLAMA3_ORIGINAL_MAX_POSITIONS / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
    )
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, interpolated, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``factor`` times longer."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_concentration(config) -> float:
    """The factor YaRN multiplies rotated queries and keys by (Megatron's and HF's): 1 without
    YaRN; attention logits grow by its square."""
    factor = config.yarn_rotary_scaling_factor
    if factor is None:
        return 1.0
    return yarn_mscale(factor, config.yarn_mscale) / yarn_mscale(factor, config.yarn_mscale_all_dim)


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, config) -> torch.Tensor:
    """YaRN's frequencies: those that turn fewer than ``beta_slow`` times over the original
    context are divided by the factor, those that turn more than ``beta_fast`` times kept, a
    linear ramp between (its bounds rounded outwards unless told not to)."""

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(config.yarn_original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(config.yarn_beta_fast), correction_dim(config.yarn_beta_slow)
    if config.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast-turning), 0: the interpolated one
    return inv_freq / config.yarn_rotary_scaling_factor * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """Rotation angles for given positions.

    Args:
        kv_channels: per-head channels; ``rotary_percent`` of them are rotated.
        rotary_base: the theta of RoPE.
        seq_len_interpolation_factor: positions are divided by it (linear interpolation).
        rope_scaling / rope_scaling_factor: Llama-3.1 frequency scaling.
        yarn_config: a config with ``yarn_rotary_scaling_factor`` set: YaRN frequencies
            (:func:`yarn_inv_freq`; attention applies :func:`yarn_concentration`).
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000,
        seq_len_interpolation_factor: float | None = None,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        yarn_config=None,
    ):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if not 0 < rotary_percent <= 1 or dim < 2 or dim % 2:
            raise ConfigError(
                f"rotary_percent ({rotary_percent}) of kv_channels ({kv_channels}) gives {dim} rotary "
                "channels; it must be in (0, 1] and give an even number >= 2"
            )
        self.dim = dim
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if rope_scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
        if yarn_config is not None:
            inv_freq = yarn_inv_freq(inv_freq, dim, rotary_base, yarn_config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Angles for ``position_ids`` [b, s]: a float32 tensor [s, b, 1, dim]."""
        positions = position_ids.to(torch.float32)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions[..., None] * self.inv_freq.to(positions.device)
        return torch.cat((freqs, freqs), dim=-1).transpose(0, 1).unsqueeze(2)
