"""MIMO rank roles: grids, data shards and the checks on placements."""

import pytest

from megatron.core.models.mimo.roles import LANGUAGE_MODEL, MimoRoles, MimoRolesError, data_index, is_model_root
from megatron.core.process_groups import RankLayout


def test_first_n_places_encoder_first_and_language_model_on_the_rest():
    roles = MimoRoles.build(6, language={"tp": 2}, modalities={"images": {"tp": 1}}, placement="first-2")
    assert list(roles.layouts["images"].ranks) == [0, 1]
    assert list(roles.layouts[LANGUAGE_MODEL].ranks) == [2, 3, 4, 5]
    assert roles.layouts[LANGUAGE_MODEL].dp == 2 and roles.layouts["images"].dp == 2
    assert not roles.colocated
    assert roles.modules_on(0) == ["images"] and roles.modules_on(3) == [LANGUAGE_MODEL]


def test_colocated_modules_share_every_rank_with_their_own_split():
    roles = MimoRoles.build(4, language={"tp": 2, "gtp": 2}, modalities={"images": {"tp": 1}})
    assert roles.colocated
    assert roles.layouts[LANGUAGE_MODEL].dp == 1 and roles.layouts["images"].dp == 4
    assert roles.modules_on(2) == [LANGUAGE_MODEL, "images"]


def test_data_index_counts_gtp_peers_as_data_shards_and_tp_peers_as_one():
    layout = RankLayout(tp=2, gtp=2, dp=1, rank_offset=2)  # ranks 2..5, tp fastest
    assert [data_index(layout, r) for r in layout.ranks] == [0, 0, 1, 1]
    assert [is_model_root(layout, r) for r in layout.ranks] == [True, False, True, False]


@pytest.mark.parametrize(
    "layouts, message",
    [
        ({LANGUAGE_MODEL: RankLayout(dp=4), "images": RankLayout(dp=2, rank_offset=2)}, "partly overlap"),
        ({LANGUAGE_MODEL: RankLayout(dp=2, rank_offset=3), "images": RankLayout(dp=2)}, "without holes"),
        (
            {LANGUAGE_MODEL: RankLayout(pp=2), "images": RankLayout(dp=2)},
            "pipeline and context parallel sizes must be 1",
        ),
        ({"images": RankLayout(dp=2)}, "need a 'language_model' layout"),
    ],
)
def test_bad_grids_are_rejected(layouts, message):
    with pytest.raises(MimoRolesError, match=message):
        MimoRoles(layouts)


def test_bad_placements_are_rejected():
    with pytest.raises(MimoRolesError, match="placement must be 'colocated' or 'first-N'"):
        MimoRoles.build(4, language={}, modalities={"images": {}}, placement="last-2")
    with pytest.raises(MimoRolesError, match="needs 0 < N < world size 4"):
        MimoRoles.build(4, language={}, modalities={"images": {}}, placement="first-4")
    with pytest.raises(MimoRolesError, match="data-parallel size 3 does not fill its 4 ranks"):
        MimoRoles.build(4, language={}, modalities={"images": {"dp": 3}})
    with pytest.raises(MimoRolesError, match="module 'images' on 2 ranks"):
        MimoRoles.build(6, language={}, modalities={"images": {"tp": 4}}, placement="first-2")
