"""TransformerBlock: stage layer placement, layout-invariant per-layer init, recompute, errors."""

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.models.gpt import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import checkpoint, init_rng_scope
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec import build_module
from megatron.core.transformer.transformer_block import (
    PipelineLayoutError,
    TransformerBlock,
    layer_offset,
    num_layers_per_stage,
    stage_layer_counts,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


def config(**kw):
    return TransformerConfig(**{"num_layers": 4, "hidden_size": 16, "num_attention_heads": 2, **kw})


@pytest.mark.parametrize(
    "num_layers, pp, first, last, counts",
    [
        (4, 2, None, None, [2, 2]),
        (5, 2, 2, None, [2, 3]),
        (5, 2, None, 1, [4, 1]),
        (8, 4, 1, 1, [1, 3, 3, 1]),
        (2, 2, 0, None, [0, 2]),  # a stage with the embedding only
        (6, 3, 2, 4, None),  # nothing left for the middle stage
    ],
)
def test_uneven_stages_put_the_rest_evenly_on_the_middle(num_layers, pp, first, last, counts):
    uneven = config(
        num_layers=num_layers, num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last
    )
    if counts is None:
        with pytest.raises(PipelineLayoutError, match="must split evenly, at least one each, over the other 1"):
            stage_layer_counts(uneven, pp)
        return
    assert stage_layer_counts(uneven, pp) == counts
    assert [layer_offset(uneven, rank, pp) for rank in range(pp)] == [sum(counts[:rank]) for rank in range(pp)]


def test_uneven_stages_need_a_pipeline_and_no_virtual_stages():
    with pytest.raises(PipelineLayoutError, match="need pipeline_model_parallel_size > 1"):
        stage_layer_counts(config(num_layers_in_first_pipeline_stage=1), 1)
    virtual = config(
        num_layers=8,
        num_layers_in_first_pipeline_stage=1,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    )
    with pytest.raises(PipelineLayoutError, match="and no virtual pipeline stages"):
        stage_layer_counts(virtual, 2)


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


# (granularity, method, num_layers) -> how often each of the 4 layers runs in a forward and
# backward (twice when its activations are recomputed), and the checkpointed units.
RECOMPUTE_RUNS = {
    ("full", None, None): ([2, 2, 2, 2], 4),
    ("full", "uniform", 2): ([2, 2, 2, 2], 2),
    ("full", "uniform", 3): ([2, 2, 2, 2], 2),
    ("full", "block", 1): ([2, 1, 1, 1], 1),
    ("full", "block", 3): ([2, 2, 2, 1], 3),
    ("selective", None, None): ([1, 1, 1, 1], 0),
}


@on_single_rank
def test_full_recompute_gives_the_same_gradients(pg):
    """Every recompute setting gives the plain run's gradients; the layers it recomputes are
    the ones Megatron's methods name (uniform: all, in units; block: the first N)."""
    x = torch.randn(6, 2, 16)

    def run(**recompute):
        block = TransformerBlock(config(**recompute), get_gpt_layer_local_spec(), pg_collection=pg)
        runs = [0] * len(block.layers)
        for index, layer in enumerate(block.layers):
            layer.register_forward_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
        units = []

        def counted(function, *args):
            units.append(function)
            return checkpoint(function, *args)

        transformer_block.checkpoint = counted
        try:
            inp = x.clone().requires_grad_()
            block(inp).square().sum().backward()
        finally:
            transformer_block.checkpoint = checkpoint
        return [inp.grad] + [p.grad for p in block.parameters()], (runs, len(units))

    plain, plain_runs = run()
    assert plain_runs == ([1, 1, 1, 1], 0)
    for (granularity, method, count), expected in RECOMPUTE_RUNS.items():
        grads, runs = run(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=count)
        assert runs == expected, (granularity, method, count)
        for a, b in zip(plain, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@on_single_rank
def test_non_first_stage_needs_an_input_tensor(pg):
    block = TransformerBlock(config(), get_gpt_layer_local_spec(), pre_process=False, pg_collection=pg)
    with pytest.raises(ValueError, match="call set_input_tensor"):
        block(None)
    x = torch.randn(6, 2, 16)
    block.set_input_tensor(x)
    assert block(None).shape == x.shape
