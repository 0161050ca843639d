"""Layout-invariant initialization: the same seed gives the same full weights under every
TP/GTP layout, and the scope leaves the caller's RNG alone."""

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_parameter,
    init_rng_scope,
)
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.tensor_parallel.helpers import collection, tp_config

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def init_normal(t):
    torch.nn.init.normal_(t, std=0.02)


def build_tiny_model(tp, g, **config_overrides):
    """Embedding, one layer (packed QKV-like column + row) and an output column, each in its scope."""
    pg = collection(tp=tp, gtp=g)
    config = tp_config(tensor_model_parallel_size=tp, **config_overrides)
    modules = {}
    with init_rng_scope(config, "embedding"):
        modules["embedding"] = VocabParallelEmbedding(10, 6, config=config, init_method=init_normal, pg_collection=pg)
    with init_rng_scope(config, "layer1"):
        modules["qkv"] = ColumnParallelLinear(
            6, 10, config=config, init_method=init_normal, output_partition_sizes=[4, 2, 4], pg_collection=pg
        )
        modules["proj"] = RowParallelLinear(4, 6, config=config, init_method=init_normal, pg_collection=pg)
    with init_rng_scope(config, "output_layer"):
        modules["output"] = ColumnParallelLinear(
            6, 10, config=config, init_method=init_normal, bias=False, pg_collection=pg
        )
    return pg, modules


def _gathered_weights_per_layout():
    out = {}
    for tp, g in LAYOUTS:
        pg, modules = build_tiny_model(tp, g)
        out[(tp, g)] = {name: gather_full_parameter(m.to(device()).weight, pg).cpu() for name, m in modules.items()}
    return out if dist.get_rank() == 0 else None


def test_gathered_full_weights_identical_for_tp1_tp2_gtp2_tp2xgtp2():
    by_layout = run_distributed(_gathered_weights_per_layout, 4)[0]
    reference = by_layout[(1, 1)]
    for layout, weights in by_layout.items():
        for name, weight in weights.items():
            torch.testing.assert_close(weight, reference[name], rtol=0, atol=0, msg=f"{name} under {layout}")
    # Different scopes and successive layers in one scope draw different weights.
    assert not torch.equal(reference["qkv"][:6], reference["output"][:6])
    assert not torch.equal(reference["embedding"], reference["output"])


def _single_rank_checks():
    config = tp_config()
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    with init_rng_scope(config, "layer1"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_next), "the scope must restore the caller's RNG"
    with init_rng_scope(config, "layer1"):
        assert torch.equal(torch.rand(3), inside)
    with init_rng_scope(tp_config(init_seed=99), "layer1"):
        assert not torch.equal(torch.rand(3), inside)

    _, zeros = build_tiny_model(1, 1, perform_initialization=False)
    assert all(torch.count_nonzero(m.weight) == 0 for m in zeros.values())
    return True


def test_scope_is_deterministic_restores_rng_and_skips_init_when_asked():
    assert run_distributed(_single_rank_checks, 1) == [True]


def _local_init_shapes():
    # Without layout invariance each rank initializes only its TP-local tensor: shapes and
    # sharding are the same, values are not tied to the TP1 weights.
    pg, modules = build_tiny_model(2, 2, layout_invariant_init=False)
    shapes = {name: tuple(m.weight.shape) for name, m in modules.items()}
    assert shapes == {"embedding": (3, 6), "qkv": (3, 6), "proj": (3, 2), "output": (3, 6)}
    assert torch.count_nonzero(modules["qkv"].weight) > 0
    return True


def test_local_initialization_without_layout_invariance_keeps_shard_shapes():
    assert run_distributed(_local_init_shapes, 4) == [True] * 4
