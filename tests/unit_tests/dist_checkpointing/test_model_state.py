"""Model (and optimizer) sharded state dicts built from parameter attributes: one main writer
per chunk under TP/PP/DP/GTP layouts, exact GTP/TP offsets and replica ids, layout-free keys,
save-at-one-layout / load-at-another round trips with identical logits, and persistent buffers
saved beside the parameters (a checkpoint written before they were still loads)."""

from collections import defaultdict

import pytest
import torch
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.dist_checkpointing import load, save, validate_records
from megatron.core.dist_checkpointing.dict_utils import iter_leaves
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.model_state import (
    checkpoint_params,
    load_model_pieces,
    model_sharded_state_dict,
    stored_pieces,
    vocab_rows,
)
from megatron.core.dist_checkpointing.optimizer_state import optimizer_sharded_state_dict
from megatron.core.dist_checkpointing.validation import ShardRecord
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.norms import build_norm
from tests.unit_tests.dist_checkpointing.tiny_models import (
    VOCAB,
    gpt_model,
    hybrid_model,
    layout,
    logits,
    tokens,
)
from tests.unit_tests.dist_harness import run_distributed


def _leaves(tree):
    built, _ = apply_factories(tree)
    return [leaf for _, leaf in iter_leaves(built) if isinstance(leaf, (ShardedTensor, ShardedObject))]


def _records_of_every_family(sizes):
    """Records of the model and distributed-optimizer state of a GPT and a hybrid model."""
    pg = layout(**sizes)
    out = {}
    for family, build in (("gpt", gpt_model), ("hybrid", hybrid_model)):
        model = build(pg)
        ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model, pg_collection=pg
        )
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp], pg)
        params = checkpoint_params(model, "", vocab_rows(model))
        tree = {"model": model.sharded_state_dict(), "optimizer": optimizer_sharded_state_dict(optimizer, params, pg)}
        out[family] = [ShardRecord.of(leaf) for leaf in _leaves(tree)]
    return out


@pytest.fixture(scope="module")
def single_rank_keys():
    (records,) = run_distributed(_records_of_every_family, 1, {})
    return {family: {(r.key, r.global_shape) for r in recs} for family, recs in records.items()}


def _check_one_main_writer_per_chunk(records_by_rank):
    mains, elements = defaultdict(list), defaultdict(int)
    for rank, records in records_by_rank.items():
        for record in records:
            if record.numel and record.is_main:
                mains[record.chunk].append(rank)
                elements[record.key] += record.numel
    assert all(len(ranks) == 1 for ranks in mains.values()), {c: r for c, r in mains.items() if len(r) > 1}
    shapes = {r.key: r.global_shape for records in records_by_rank.values() for r in records}
    for key, shape in shapes.items():
        assert elements[key] == torch.Size(shape).numel(), key
    validate_records(records_by_rank)  # also: no overlap, consistent shapes


@pytest.mark.parametrize(
    "name, world, sizes",
    [
        ("TP2xGTP2xDP2", 8, dict(tp=2, gtp=2)),
        ("TP2xPP2xDP2", 8, dict(tp=2, pp=2)),
        ("TP2xGTP2", 4, dict(tp=2, gtp=2)),
        ("CP2xGTP2xDP2", 8, dict(cp=2, gtp=2)),
    ],
)
def test_every_chunk_of_gpt_hybrid_and_optimizer_has_one_main_writer(single_rank_keys, name, world, sizes):
    per_rank = run_distributed(_records_of_every_family, world, sizes)
    for family in ("gpt", "hybrid"):
        records_by_rank = {rank: records[family] for rank, records in enumerate(per_rank)}
        _check_one_main_writer_per_chunk(records_by_rank)
        keys = {(r.key, r.global_shape) for records in records_by_rank.values() for r in records}
        assert keys == single_rank_keys[family]  # global layer numbers, true (unpadded) shapes
    vocab_keys = {k: s for k, s in single_rank_keys["gpt"] if k == "embedding.word_embeddings.weight"}
    assert vocab_keys == {"embedding.word_embeddings.weight": (VOCAB, 32)}
    assert ("decoder.layers.3.mixer.A_log", (8,)) not in single_rank_keys["hybrid"]  # layer 4 is the MLP
    assert ("decoder.layers.2.mixer.A_log", (8,)) in single_rank_keys["hybrid"]
    assert ("optimizer.state.exp_avg.decoder.layers.2.mixer.dt_bias", (8,)) in single_rank_keys["hybrid"]


class _Toy(nn.Module):
    """Column-, row-parallel and embedding weights whose TP-local rows (3) G=2 does not divide,
    plus replicated biases and a norm."""

    def __init__(self, pg, tp_of_sizes=None):
        super().__init__()
        tp = tp_of_sizes or pg.size("tp")
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        torch.manual_seed(0)
        self.column = ColumnParallelLinear(4, 3 * tp, config=config, init_method=nn.init.normal_, pg_collection=pg)
        self.row = RowParallelLinear(2 * tp, 5, config=config, init_method=nn.init.normal_, pg_collection=pg)
        self.embedding = VocabParallelEmbedding(3 * tp, 4, config=config, init_method=nn.init.normal_, pg_collection=pg)
        self.norm = build_norm(config, 4)


def _toy_pieces(layout_kwargs):
    layout_ = RankLayout.for_world(torch.distributed.get_world_size(), **layout_kwargs)
    pg = ProcessGroupCollection.from_layout(layout_)
    pieces = {}
    for leaf in _leaves(model_sharded_state_dict(_Toy(pg), pg)):
        pieces[leaf.key] = (leaf.global_offset, leaf.local_shape, leaf.global_shape, leaf.replica_id, leaf.data.clone())
    coords = {axis: pg.rank(axis) for axis in ("tp", "gtp", "dp", "cp")}
    return coords, pieces


def _full_toy_tensors(tp_of_sizes):
    """The full weights one rank builds for the sizes of a TP=``tp_of_sizes`` toy (same seed:
    layout-invariant initialization makes every layout slice these)."""
    return {n: p.detach().clone() for n, p in _Toy(layout(), tp_of_sizes).named_parameters()}


@pytest.mark.parametrize("world, layout_kwargs", [(4, dict(tp=2, gtp=2)), (8, dict(gtp=2, cp=2))])
def test_gtp_peers_get_exact_rows_and_distinct_replica_ids(world, layout_kwargs):
    """TP2xGTP2, and GTP2xCP2xDP2 on a hand-built collection (the models refuse CP > 1, the
    parallel layers do not)."""
    results = run_distributed(_toy_pieces, world, layout_kwargs)
    for coords, pieces in results:
        t, g = coords["tp"], coords["gtp"]
        rows = (2, 1)[g]  # 3 TP-local rows over G=2: 2 + 1
        assert pieces["column.weight"][:3] == ((3 * t + 2 * g, 0), (rows, 4), (3 * layout_kwargs.get("tp", 1), 4))
        assert pieces["embedding.weight"][:2] == ((3 * t + 2 * g, 0), (rows, 4))
        assert pieces["row.weight"][:2] == ((3 * g, 2 * t), ((3, 2)[g], 2))  # GTP on dim 0, TP on dim 1
        dp_cp = coords["dp"] * layout_kwargs.get("cp", 1) + coords["cp"]
        assert pieces["column.weight"][3] == (0, 0, dp_cp)
        assert pieces["column.bias"][3] == (0, g, dp_cp)  # TP-sharded, whole on every GTP peer
        assert pieces["row.bias"][3] == (t, g, dp_cp)
        assert pieces["norm.weight"][3] == (t, g, dp_cp)
    by_peer_group = defaultdict(list)
    for coords, pieces in results:
        by_peer_group[(coords["tp"], coords["dp"], coords["cp"])].append(pieces)
    for peers in by_peer_group.values():
        for key in ("column.weight", "row.weight", "embedding.weight"):
            assert len({p[key][0] for p in peers}) == len(peers)  # distinct offsets
        for key in ("column.bias", "row.bias", "norm.weight"):
            assert len({p[key][3] for p in peers}) == len(peers)  # distinct replica ids
    records = {
        rank: [ShardRecord("tensor", k, v[0], v[1], v[2], "float32", v[3]) for k, v in pieces.items()]
        for rank, (_, pieces) in enumerate(results)
    }
    validate_records(records)


def test_gtp_pieces_hold_the_rows_of_the_full_weight():
    (full,) = run_distributed(_full_toy_tensors, 1, 2)
    for _, pieces in run_distributed(_toy_pieces, 4, dict(tp=2, gtp=2)):
        for key, (offset, shape, global_shape, _, data) in pieces.items():
            assert global_shape == tuple(full[key].shape)
            assert torch.equal(data, full[key][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]), key


BUILDERS = {"gpt": gpt_model, "hybrid": hybrid_model}


def _save_with_logits(family, sizes, path):
    pg = layout(**sizes)
    model = BUILDERS[family](pg, seed=1)
    save({"model": model.sharded_state_dict()}, path)
    return logits(model, pg, tokens())


def _load_with_logits(family, sizes, path):
    """Logits of a differently seeded model before and after loading ``path``."""
    pg = layout(**sizes)
    model = BUILDERS[family](pg, seed=2)
    before = logits(model, pg, tokens())
    load_model_pieces(model, load({"model": model.sharded_state_dict()}, path)["model"])
    return before, logits(model, pg, tokens())


@pytest.mark.parametrize(
    "family, saved, loaded",
    [
        ("gpt", (4, dict(tp=2, pp=2)), (1, {})),
        ("gpt", (1, {}), (4, dict(tp=2, gtp=2))),
        ("gpt", (4, dict(gtp=2)), (4, dict(pp=2))),
        ("hybrid", (2, dict(pp=2)), (1, {})),
    ],
    ids=["TP2xPP2->TP1", "TP1->TP2xGTP2", "GTP2xDP2->PP2xDP2", "hybrid-PP2->PP1"],
)
def test_save_at_one_layout_load_at_another_gives_identical_logits(tmp_path, family, saved, loaded):
    path = str(tmp_path / "ckpt")
    expected = [r for r in run_distributed(_save_with_logits, saved[0], family, saved[1], path) if r is not None][0]
    results = [r for r in run_distributed(_load_with_logits, loaded[0], family, loaded[1], path) if r[0] is not None]
    for before, after in results:  # every data-parallel replica of the last stage
        assert not torch.allclose(before, expected, atol=1e-3)  # the load, not the seed, makes them equal
        torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


class _WithState(nn.Module):
    """A parameter, a persistent buffer (state a step changes outside the optimizer, like an
    expert bias) and a non-persistent one (scratch) in a submodule."""

    def __init__(self, fill: float):
        super().__init__()
        self.inner = nn.Module()
        self.inner.weight = nn.Parameter(torch.full((3,), fill))
        self.inner.register_buffer("state", torch.full((4,), fill))
        self.inner.register_buffer("scratch", torch.full((2,), fill), persistent=False)


def _buffer_round_trip(path):
    pg = layout()
    saved = _WithState(1.0)
    pieces = model_sharded_state_dict(saved, pg)
    assert sorted(pieces) == ["inner.state", "inner.weight"]  # state_dict()'s keys: no scratch buffer
    save({"model": pieces}, f"{path}/new")
    params_only = {spec.name: pieces[spec.name] for spec in checkpoint_params(saved)}
    save({"model": params_only}, f"{path}/old")  # as written before buffers were checkpointed
    out = {}
    for name in ("new", "old"):
        model = _WithState(7.0)
        request = stored_pieces(model, model_sharded_state_dict(model, pg), f"{path}/{name}")
        load_model_pieces(model, load({"model": request}, f"{path}/{name}")["model"])
        out[name] = {k: v.tolist() for k, v in model.inner._buffers.items()} | {"weight": model.inner.weight.tolist()}
    return out


def test_persistent_buffers_are_saved_and_an_older_checkpoint_without_them_loads(tmp_path):
    (out,) = run_distributed(_buffer_round_trip, 1, str(tmp_path))
    assert out["new"] == {"state": [1.0] * 4, "scratch": [7.0] * 2, "weight": [1.0] * 3}
    assert out["old"] == {"state": [7.0] * 4, "scratch": [7.0] * 2, "weight": [1.0] * 3}  # the buffer keeps its value
