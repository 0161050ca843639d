"""RoPE: each channel pair (i, i + d/2) rotates by position * base^(-2i/d)."""

import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.core.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb, llama3_scaled_inv_freq


def rotate_by_hand(t, positions, dim, base):
    """Complex multiplication of (t[i], t[i + dim/2]) by exp(i * pos * theta_i)."""
    out = t.clone().double()
    half = dim // 2
    for s, pos in enumerate(positions):
        for i in range(half):
            angle = pos * base ** (-2 * i / dim)
            a, b = t[s, ..., i].double(), t[s, ..., i + half].double()
            out[s, ..., i] = a * math.cos(angle) - b * math.sin(angle)
            out[s, ..., i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def test_rotation_matches_hand_computation_and_partial_rotation_passes_the_rest():
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=0.5, rotary_base=100)
    positions = torch.tensor([[0, 3, 7]])
    t = torch.randn(3, 1, 2, 8)
    out = apply_rotary_pos_emb(t, rope(positions))
    torch.testing.assert_close(out[..., :4].double(), rotate_by_hand(t[..., :4], [0, 3, 7], 4, 100))
    assert torch.equal(out[..., 4:], t[..., 4:])


def test_interleaved_rotation_turns_neighbouring_channels_by_hand():
    """GPT-J's layout (Megatron's --rotary-interleaved): pair (2i, 2i + 1) turns by pos * theta_i."""
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=0.5, rotary_base=100)
    positions = [0, 3, 7]
    t = torch.randn(3, 1, 2, 8)
    out = apply_rotary_pos_emb(t, rope(torch.tensor([positions])), interleaved=True)
    # the same turns as the halves layout, applied to the channels taken as [0, 2 | 1, 3]
    by_hand = rotate_by_hand(t[..., [0, 2, 1, 3]], positions, 4, 100)
    torch.testing.assert_close(out[..., [0, 2, 1, 3]].double(), by_hand)
    assert torch.equal(out[..., 4:], t[..., 4:])


def test_interpolation_factor_divides_positions():
    plain, interpolated = RotaryEmbedding(8), RotaryEmbedding(8, seq_len_interpolation_factor=4.0)
    torch.testing.assert_close(interpolated(torch.tensor([[8]])), plain(torch.tensor([[2]])))


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    scaled = llama3_scaled_inv_freq(inv_freq, 8.0)
    wavelen = 2 * math.pi / inv_freq
    high, low = wavelen < 8192 / 4, wavelen > 8192
    assert torch.equal(scaled[high], inv_freq[high])
    torch.testing.assert_close(scaled[low], inv_freq[low] / 8.0)
    middle = ~high & ~low
    assert ((scaled[middle] <= inv_freq[middle]) & (scaled[middle] >= inv_freq[middle] / 8.0)).all()


def test_rotary_dim_must_be_even():
    with pytest.raises(ConfigError, match="must be in \\(0, 1\\] and give an even number"):
        RotaryEmbedding(kv_channels=6, rotary_percent=0.5)
