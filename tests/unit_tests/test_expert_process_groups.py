"""Expert groups (ep, expt_tp, expt_dp, expt_mp) folded from the dense layout as Megatron
folds them, checked against hand-written tables, an independent numpy folding, and real
gloo groups."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups import EXPERT_GROUP_NAMES, ParallelConfigError, ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import device, run_distributed


def numpy_expert_groups(layout: RankLayout) -> dict[str, list[list[int]]]:
    """Independent folding: take each (gtp, pp) slice of the rank grid, flatten its tp/cp/dp
    ranks in order-string order (fastest first) and reshape that line as (edp, ep, etp)."""
    order = layout.axes
    shape = [layout.size(a) for a in reversed(order)]
    grid = np.arange(layout.world_size).reshape(shape) + layout.rank_offset
    reversed_axes = list(reversed(order))
    stage_axes = [a for a in reversed_axes if a in ("tp", "cp", "dp")]  # slowest first
    outer = [a for a in reversed_axes if a not in stage_axes]
    grid = grid.transpose([reversed_axes.index(a) for a in outer + stage_axes])
    # dims: gtp/pp (in order), then edp, ep, etp
    folded = grid.reshape([layout.size(a) for a in outer] + [layout.expert_dp, layout.ep, layout.etp])
    dims = {name: i for i, name in enumerate(outer + ["edp", "ep", "etp"])}

    def rows(axes):
        varying = [dims[a] for a in axes]
        rest = [d for d in range(folded.ndim) if d not in varying]
        flat = folded.transpose(rest + varying).reshape(-1, int(np.prod([folded.shape[d] for d in varying])))
        return sorted(sorted(int(r) for r in row) for row in flat)

    return {
        "ep": rows(["ep"]),
        "expt_tp": rows(["etp"]),
        "expt_dp": rows(["edp"]),
        "expt_mp": rows(["etp", "ep", "gtp", "pp"]),
    }


def test_hand_written_table_tp2_dp4_ep2():
    # Megatron's example: 8 ranks, TP 2, EP 2, ETP 1 -> expert-DP 4.
    layout = RankLayout(tp=2, dp=4, ep=2, etp=1)
    assert layout.expert_dp == 4
    assert layout.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("expt_tp") == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert layout.group_ranks("expt_dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.group_ranks("expt_mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_hand_written_table_tp2_dp2_pp2_ep2():
    layout = RankLayout(tp=2, dp=2, pp=2, ep=2, etp=1)
    assert layout.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("expt_dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("expt_mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_hand_written_table_ep2_with_etp2():
    # ETP defaults to TP: TP 2, EP 2 on 4 ranks leaves expert-DP 1.
    layout = RankLayout(tp=2, dp=2, ep=2)
    assert layout.etp == 2 and layout.expert_dp == 1
    assert layout.group_ranks("expt_tp") == [[0, 1], [2, 3]]
    assert layout.group_ranks("ep") == [[0, 2], [1, 3]]
    assert layout.group_ranks("expt_dp") == [[0], [1], [2], [3]]
    assert layout.group_ranks("expt_mp") == [[0, 1, 2, 3]]


def test_hand_written_table_cp_folds_into_ep():
    # Megatron's expert grid has no CP axis: CP ranks become EP / expert-DP ranks.
    layout = RankLayout(cp=2, dp=2, ep=4)
    assert layout.group_ranks("ep") == [[0, 1, 2, 3]]
    assert layout.group_ranks("expt_dp") == [[0], [1], [2], [3]]


def test_hand_written_table_pipeline_not_last_in_order():
    layout = RankLayout(tp=2, dp=2, pp=2, ep=2, etp=1, order="tp-gtp-cp-pp-dp")
    # rank = t + 2p + 4d; the stage of pp coordinate p holds {t + 4d}
    assert layout.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("expt_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


EXPERT_LAYOUTS = [
    dict(tp=2, dp=4, ep=2, etp=1),
    dict(tp=2, dp=4, ep=4, etp=2),
    dict(tp=2, dp=4, ep=2, etp=4),
    dict(tp=4, dp=2, ep=2, etp=1),
    dict(tp=2, cp=2, dp=2, pp=2, ep=4, etp=1),
    dict(tp=2, cp=2, dp=2, ep=2, order="dp-tp-cp-gtp-pp"),
    dict(tp=2, dp=2, pp=2, ep=2, order="pp-tp-gtp-cp-dp", rank_offset=3),
    dict(tp=2, gtp=2, dp=2),
]


@pytest.mark.parametrize("sizes", EXPERT_LAYOUTS, ids=str)
def test_expert_groups_match_numpy_folding_and_span_the_stage(sizes):
    layout = RankLayout(**sizes)
    expected = numpy_expert_groups(layout)
    for name in EXPERT_GROUP_NAMES:
        groups = layout.group_ranks(name)
        assert groups == expected[name], name
        assert sorted(r for g in groups for r in g) == list(layout.ranks), f"{name} must partition the grid"
    # EP x ETP x expert-DP spans exactly the TP x CP x DP ranks of one stage
    stage = {tuple(g) for g in layout.group_ranks("tp_dp_cp")}
    for group in layout.expert_rank_groups(["etp", "ep", "edp"]):
        assert tuple(group) in stage


def test_expert_layout_errors_name_the_numbers():
    with pytest.raises(ParallelConfigError, match=r"ep\*etp = 4\*1 = 4 does not divide the tp\*cp\*dp = 2\*1\*3 = 6"):
        RankLayout(tp=2, dp=3, ep=4, etp=1)
    with pytest.raises(ParallelConfigError, match=r"ep\*etp = 1\*3 = 3 does not divide"):
        RankLayout(tp=2, dp=2, etp=3)
    with pytest.raises(ParallelConfigError, match="ep size must be an integer >= 1, got 0"):
        RankLayout(ep=0)
    with pytest.raises(ParallelConfigError, match=r"expert parallelism \(ep 2, etp 1\) with gtp 2 is not supported"):
        RankLayout(gtp=2, dp=2, ep=2)


def _expert_collection():
    pgc = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    me = dist.get_rank()
    table = numpy_expert_groups(RankLayout(tp=2, dp=2, ep=2, etp=1))
    sums = {}
    for name in EXPERT_GROUP_NAMES:
        (mine,) = [g for g in table[name] if me in g]
        group = getattr(pgc, name)
        assert dist.get_process_group_ranks(group) == mine, name
        total = torch.tensor([float(me)], device=device())
        dist.all_reduce(total, group=group)
        sums[name] = total.item()
    assert pgc.size("ep") == 2 and pgc.rank("ep") == me % 2
    assert pgc.expert_dp_group() is pgc.expt_dp and pgc.expert_mp_group() is pgc.expt_mp
    return sums


def test_world_collection_has_real_expert_groups():
    sums = run_distributed(_expert_collection, 4)
    # ep pairs {0,1},{2,3}; expt_dp {0,2},{1,3}; expt_tp singletons
    assert [s["ep"] for s in sums] == [1.0, 1.0, 5.0, 5.0]
    assert [s["expt_dp"] for s in sums] == [2.0, 4.0, 2.0, 4.0]
    assert [s["expt_tp"] for s in sums] == [0.0, 1.0, 2.0, 3.0]


def _collection_without_expert_parallelism():
    pgc = ProcessGroupCollection.from_layout(RankLayout(tp=2))
    assert not pgc.has("ep") and pgc.size("ep") == 1 and pgc.rank("ep") == 0
    assert pgc.expt_tp is pgc.tp and pgc.expt_dp is pgc.dp_cp and pgc.expt_mp is pgc.mp
    hand = ProcessGroupCollection(dp_cp=pgc.dp_cp, mp=pgc.mp)
    assert hand.expert_dp_group() is pgc.dp_cp and hand.expert_mp_group() is pgc.mp
    return True


def test_expert_groups_without_expert_parallelism_reuse_dense_groups():
    assert run_distributed(_collection_without_expert_parallelism, 2) == [True, True]
