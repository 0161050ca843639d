"""Memberships of every collection group, checked against an independent numpy computation,
and proven to exist on the backend by all-reducing rank ids."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups import (
    GROUP_AXES,
    GROUP_NAMES,
    MissingProcessGroupError,
    ParallelConfigError,
    ProcessGroupCollection,
    RankLayout,
)
from tests.unit_tests.dist_harness import device, run_distributed

ORDER = ("tp", "gtp", "cp", "dp", "pp")


def expected_groups(sizes: dict, axes, order=ORDER, offset=0):
    """Rank lists over ``axes``: lay the ranks out as an array whose C-order last dim is
    the fastest axis, move the chosen axes last and read the rows."""
    shape = [sizes[a] for a in reversed(order)]
    grid = np.arange(int(np.prod(shape))).reshape(shape) + offset
    dims = [list(reversed(order)).index(a) for a in axes]
    rest = [d for d in range(len(shape)) if d not in dims]
    rows = grid.transpose(rest + dims).reshape(-1, int(np.prod([shape[d] for d in dims])))
    return sorted(sorted(int(r) for r in row) for row in rows)


def expected_embedding_groups(sizes, order=ORDER, offset=0, last=True):
    groups = []
    for pipeline in expected_groups(sizes, ["pp"], order, offset):
        # members ascending; stage index of a member = its pp coordinate
        stride = int(np.prod([sizes[a] for a in order[: order.index("pp")]]))
        by_stage = sorted(pipeline, key=lambda r: ((r - offset) // stride) % sizes["pp"])
        ends = {by_stage[0], by_stage[-1]} if last else {by_stage[0]}
        groups.append(sorted(ends))
    return sorted(groups)


def expected_all(sizes, order=ORDER, offset=0):
    table = {name: expected_groups(sizes, axes, order, offset) for name, axes in GROUP_AXES.items()}
    table["embd"] = expected_embedding_groups(sizes, order, offset, last=True)
    table["pos_embd"] = expected_embedding_groups(sizes, order, offset, last=False)
    # Without expert parallelism (EP 1, ETP = TP) the expert groups are the dense ones
    # and no ep group is made (test_expert_process_groups.py covers EP > 1).
    table |= {"ep": [], "expt_tp": table["tp"], "expt_dp": table["dp_cp"], "expt_mp": table["mp"]}
    return table


LAYOUTS = [
    dict(tp=1, gtp=1, cp=1, dp=1, pp=1),
    dict(tp=2, gtp=1, cp=1, dp=1, pp=1),
    dict(tp=1, gtp=1, cp=1, dp=1, pp=2),
    dict(tp=2, gtp=2, cp=1, dp=1, pp=1),
    dict(tp=1, gtp=2, cp=1, dp=1, pp=2),
    dict(tp=2, gtp=2, cp=1, dp=2, pp=1),
    dict(tp=2, gtp=1, cp=1, dp=2, pp=2),
    dict(tp=1, gtp=2, cp=2, dp=2, pp=1),
    dict(tp=2, gtp=1, cp=2, dp=1, pp=2),
    dict(tp=8, gtp=1, cp=1, dp=1, pp=1),
    dict(tp=1, gtp=1, cp=1, dp=1, pp=8),
]


def _layout_id(sizes):
    return "x".join(f"{k.upper()}{v}" for k, v in sizes.items() if v > 1) or "single"


def _check_world_groups(sizes):
    """On every rank: memberships match the table, and an all-reduce of rank ids on each
    group sums the members."""
    pgc = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=sizes["pp"],
        context_parallel_size=sizes["cp"],
        generalized_tensor_parallel_size=sizes["gtp"],
    )
    assert parallel_state.get_process_group_collection() is pgc
    me = dist.get_rank()
    table = expected_all(sizes)
    checked = []
    for name in GROUP_NAMES:
        mine = [g for g in table[name] if me in g]
        if not mine:
            assert not pgc.has(name)
            with pytest.raises(MissingProcessGroupError, match=name):
                getattr(pgc, name)
            continue
        group = getattr(pgc, name)
        assert dist.get_process_group_ranks(group) == mine[0], name
        total = torch.tensor([float(me)], device=device())
        dist.all_reduce(total, group=group)
        assert total.item() == sum(mine[0]), name
        checked.append(name)
    _check_megatron_getters(table, me)
    return checked


def _check_megatron_getters(table, me):
    """Megatron's ``parallel_state`` getters name the table's groups, and their ranks and
    world sizes are this rank's place in them."""
    ps = parallel_state
    groups = {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "cp": ps.get_context_parallel_group,
        "gtp": ps.get_generalized_tensor_parallel_group,
        "dp": ps.get_data_parallel_group,
        "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "dp_cp_gtp": lambda: ps.get_data_parallel_group(with_gtp=True),
        "mp": ps.get_model_parallel_group,
        "expt_tp": ps.get_expert_tensor_parallel_group,
        "expt_dp": ps.get_expert_data_parallel_group,
        "embd": ps.get_embedding_group,
        "pos_embd": ps.get_position_embedding_group,
    }
    for name, getter in groups.items():
        mine = [g for g in table[name] if me in g]
        if mine:
            assert dist.get_process_group_ranks(getter()) == mine[0], name
    places = {
        "tp": (ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_world_size),
        "pp": (ps.get_pipeline_model_parallel_rank, ps.get_pipeline_model_parallel_world_size),
        "cp": (ps.get_context_parallel_rank, ps.get_context_parallel_world_size),
        "gtp": (ps.get_generalized_tensor_parallel_rank, ps.get_generalized_tensor_parallel_world_size),
        "dp": (ps.get_data_parallel_rank, ps.get_data_parallel_world_size),
        "dp_cp": (
            lambda: ps.get_data_parallel_rank(with_context_parallel=True),
            lambda: ps.get_data_parallel_world_size(with_context_parallel=True),
        ),
    }
    for name, (rank, world_size) in places.items():
        (group,) = [g for g in table[name] if me in g]
        assert (rank(), world_size()) == (group.index(me), len(group)), name
    (pipeline,) = [g for g in table["pp"] if me in g]
    assert ps.is_pipeline_first_stage() == (me == pipeline[0])
    assert ps.is_pipeline_last_stage() == (me == pipeline[-1])
    assert (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()) == (0, 1)


@pytest.mark.parametrize("sizes", LAYOUTS, ids=_layout_id)
def test_world_collection_groups_match_independent_table(sizes):
    world = int(np.prod(list(sizes.values())))
    checked = run_distributed(_check_world_groups, world, sizes)
    for name in ("tp", "pp", "cp", "gtp", "dp", "dp_cp", "dp_cp_gtp", "mp", "tp_cp", "tp_dp_cp", "pos_embd"):
        assert name in checked[0]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=_layout_id)
def test_group_properties(sizes):
    layout = RankLayout(**sizes)
    world = set(range(layout.world_size))
    for name in GROUP_AXES:
        groups = layout.group_ranks(name)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world), f"{name} groups must partition the world"
    # dp_cp_gtp is the union of dp_cp over GTP peers
    dp_cp = layout.group_ranks("dp_cp")
    for big in layout.group_ranks("dp_cp_gtp"):
        parts = [g for g in dp_cp if set(g) <= set(big)]
        assert sorted(r for g in parts for r in g) == big
        assert len(parts) == sizes["gtp"]
    # dp_cp never holds two GTP peers of one shard
    for replica_group in dp_cp:
        for gtp_group in layout.group_ranks("gtp"):
            assert len(set(replica_group) & set(gtp_group)) <= 1


def test_hand_written_table_tp2_gtp2_dp2():
    layout = RankLayout(tp=2, gtp=2, dp=2)
    assert layout.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("gtp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_ranks("dp_cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_ranks("dp_cp_gtp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.group_ranks("mp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.group_ranks("embd") == [[0], [1], [2], [3], [4], [5], [6], [7]]


def test_hand_written_table_tp2_pp2_dp2():
    layout = RankLayout(tp=2, dp=2, pp=2)
    assert layout.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_ranks("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.group_ranks("embd") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_ranks("pos_embd") == [[0], [1], [2], [3]]
    assert layout.group_ranks("tp_dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_custom_order_changes_memberships():
    layout = RankLayout(tp=2, dp=2, order="dp-tp-gtp-cp-pp")
    assert layout.group_ranks("dp") == [[0, 1], [2, 3]]
    assert layout.group_ranks("tp") == [[0, 2], [1, 3]]
    assert layout.group_ranks("tp") == expected_groups(
        dict(tp=2, gtp=1, cp=1, dp=2, pp=1), ["tp"], order=("dp", "tp", "gtp", "cp", "pp")
    )


def _subgrid_collection():
    me = dist.get_rank()
    if me < 4:
        return None
    layout = RankLayout(tp=2, gtp=2, rank_offset=4)
    pgc = ProcessGroupCollection.from_layout(layout)
    assert not parallel_state.model_parallel_is_initialized()
    table = expected_all(dict(tp=2, gtp=2, cp=1, dp=1, pp=1), offset=4)
    out = {}
    for name in ("tp", "gtp", "dp_cp_gtp", "mp", "dp"):
        (mine,) = [g for g in table[name] if me in g]
        group = getattr(pgc, name)
        assert dist.get_process_group_ranks(group) == mine
        total = torch.tensor([float(me)])
        dist.all_reduce(total, group=group)
        out[name] = total.item()
    return out


def test_subgrid_collection_on_ranks_4_to_7_without_global_state():
    results = run_distributed(_subgrid_collection, 8)
    assert results[:4] == [None] * 4
    assert results[4] == {"tp": 9.0, "gtp": 10.0, "dp_cp_gtp": 10.0, "mp": 22.0, "dp": 4.0}
    assert results[7] == {"tp": 13.0, "gtp": 12.0, "dp_cp_gtp": 12.0, "mp": 22.0, "dp": 7.0}


def _hand_built_collection():
    tp = dist.new_group([0, 1])
    pgc = ProcessGroupCollection(tp=tp)
    assert pgc.size("tp") == 2 and pgc.size("gtp") == 1 and pgc.rank("gtp") == 0
    assert pgc.provided() == ["tp"]
    with pytest.raises(MissingProcessGroupError, match="'dp_cp'"):
        _ = pgc.dp_cp
    return pgc.rank("tp")


def test_hand_built_collection_and_missing_group_error():
    assert run_distributed(_hand_built_collection, 2) == [0, 1]


def _invalid_initialization(kwargs, message):
    with pytest.raises(ValueError, match=message):
        parallel_state.initialize_model_parallel(**kwargs)
    assert not parallel_state.model_parallel_is_initialized()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tensor_model_parallel_size=3), r"world size 4 is not a multiple of tp\*gtp\*cp\*pp = 3\*1\*1\*1 = 3"),
        (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4), r"world size 4 .* = 2\*1\*1\*4 = 8"),
        (dict(generalized_tensor_parallel_size=0), r"gtp size must be an integer >= 1, got 0"),
        (dict(context_parallel_size=-2), r"cp size must be an integer >= 1, got -2"),
        (dict(order="tp-gtp-cp-dp-xp"), r"unknown axis 'xp'"),
        (dict(order="tp-tp-cp-dp-pp"), r"repeats axis 'tp'"),
        (dict(order="tp-cp-dp-pp"), r"lacks axis 'gtp'"),
    ],
)
def test_invalid_configurations_name_the_numbers(kwargs, message):
    run_distributed(_invalid_initialization, 4, kwargs, message)


def test_layout_validation_without_processes():
    with pytest.raises(ParallelConfigError, match="tp size must be an integer >= 1, got 0"):
        RankLayout(tp=0)
    with pytest.raises(ParallelConfigError, match="unknown axis 'ep'"):
        RankLayout(tp=2).rank_groups("tp-ep")
