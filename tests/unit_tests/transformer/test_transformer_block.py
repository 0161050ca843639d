"""TransformerBlock: stage layer placement, layout-invariant per-layer init, recompute, errors."""

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.models.gpt import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import init_rng_scope
from megatron.core.transformer.spec import build_module
from megatron.core.transformer.transformer_block import (
    PipelineLayoutError,
    TransformerBlock,
    layer_offset,
    num_layers_per_stage,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


def config(**kw):
    return TransformerConfig(**{"num_layers": 4, "hidden_size": 16, "num_attention_heads": 2, **kw})


def test_layer_offsets_per_stage():
    assert [layer_offset(config(), rank, 2) for rank in range(2)] == [0, 2]
    assert [layer_offset(config(), rank, 4) for rank in range(4)] == [0, 1, 2, 3]
    assert num_layers_per_stage(config(), 2) == 2
    with pytest.raises(PipelineLayoutError, match="num_layers \\(4\\) must be a positive multiple of .* \\(3\\)"):
        layer_offset(config(), 0, 3)


@on_single_rank
def test_layers_have_global_numbers_and_per_layer_init(pg):
    block = TransformerBlock(config(), get_gpt_layer_local_spec(), pg_collection=pg)
    assert block.layer_numbers == [1, 2, 3, 4]
    assert [layer.layer_number for layer in block.layers] == [1, 2, 3, 4]
    with init_rng_scope(config(), "layer3"):
        alone = build_module(get_gpt_layer_local_spec(), config=config(), layer_number=3, pg_collection=pg)
    for (name, a), (_, b) in zip(block.layers[2].named_parameters(), alone.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert block.final_layernorm is not None
    assert (
        TransformerBlock(config(), get_gpt_layer_local_spec(), post_process=False, pg_collection=pg).final_layernorm
        is None
    )


@on_single_rank
def test_full_recompute_gives_the_same_gradients(pg):
    grads = []
    x = torch.randn(6, 2, 16)
    for granularity in (None, "full", "selective"):
        block = TransformerBlock(
            config(recompute_granularity=granularity), get_gpt_layer_local_spec(), pg_collection=pg
        )
        inp = x.clone().requires_grad_()
        block(inp).square().sum().backward()
        grads.append([inp.grad] + [p.grad for p in block.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@on_single_rank
def test_non_first_stage_needs_an_input_tensor(pg):
    block = TransformerBlock(config(), get_gpt_layer_local_spec(), pre_process=False, pg_collection=pg)
    with pytest.raises(ValueError, match="call set_input_tensor"):
        block(None)
    x = torch.randn(6, 2, 16)
    block.set_input_tensor(x)
    assert block(None).shape == x.shape
