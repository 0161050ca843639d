"""LayerNorm / RMSNorm against formulas in float64, and their sharding attributes."""

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.transformer.norms import LayerNorm, RMSNorm, build_norm


def config(**kw):
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, layernorm_epsilon=1e-5, **kw)


def perturbed(norm):
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p))
    return norm


def test_layernorm_matches_formula():
    norm = perturbed(build_norm(config(normalization="LayerNorm")))
    assert isinstance(norm, LayerNorm)
    x = torch.randn(3, 2, 16)
    x64 = x.double()
    normed = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(
        norm(x).double(), normed * norm.weight.double() + norm.bias.double(), rtol=1e-5, atol=1e-5
    )


def test_rmsnorm_matches_formula():
    norm = perturbed(build_norm(config(normalization="RMSNorm")))
    assert isinstance(norm, RMSNorm) and not hasattr(norm, "bias")
    x = torch.randn(3, 2, 16)
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_norm_weights_are_replicated_and_flag_sequence_parallel(sequence_parallel):
    norm = build_norm(config(normalization="LayerNorm", sequence_parallel=sequence_parallel), hidden_size=8)
    for p in norm.parameters():
        assert p.shape == (8,)
        assert not p.tensor_model_parallel and not p.gtp_sharded and p.partition_dim == -1
        assert p.sequence_parallel is sequence_parallel
