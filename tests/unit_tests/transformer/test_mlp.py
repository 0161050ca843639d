"""MLP: GELU and SwiGLU against hand computation."""

import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.transformer.mlp import MLP, gelu_tanh
from tests.unit_tests.transformer.single_rank import on_single_rank


@on_single_rank
def test_swiglu_is_silu_of_gate_times_up(pg):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=24,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
    )
    mlp = MLP(config, pg_collection=pg)
    assert mlp.linear_fc1.weight.shape == (48, 16)
    x = torch.randn(3, 2, 16)
    gate, up = mlp.linear_fc1.weight[:24], mlp.linear_fc1.weight[24:]
    expected = (F.silu(x @ gate.t()) * (x @ up.t())) @ mlp.linear_fc2.weight.t()
    out, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@on_single_rank
def test_gelu_mlp_with_bias(pg):
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, activation_func=gelu_tanh)
    mlp = MLP(config, pg_collection=pg)
    with torch.no_grad():
        mlp.linear_fc1.bias.normal_()
    x = torch.randn(3, 2, 16)
    hidden = x @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
    expected = (
        0.5 * hidden * (1 + torch.tanh(0.7978845608 * (hidden + 0.044715 * hidden**3)))
    ) @ mlp.linear_fc2.weight.t()
    out, bias = mlp(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert bias is mlp.linear_fc2.bias
