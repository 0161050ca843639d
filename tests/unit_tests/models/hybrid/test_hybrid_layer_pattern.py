"""Hybrid layer patterns: parsing, error messages that point at the character at fault,
legacy ratio allocation, and the per-stage layer lists."""

import pytest

from megatron.core.config import ConfigError
from megatron.core.models.hybrid.hybrid_layer_pattern import (
    HybridPatternError,
    allocate_layer_pattern,
    parse_hybrid_pattern,
    resolve_hybrid_pattern,
    select_stage_layers,
)


def test_parse_splits_stages_and_mtp_patterns():
    parsed = parse_hybrid_pattern("M*M-|M*--/*-/M-")
    assert parsed.segments == ("M*M-", "M*--")
    assert parsed.layers == "M*M-M*--"
    assert parsed.num_layers == 8
    assert parsed.mtp_patterns == ("*-", "M-")


def test_bad_character_is_pointed_at():
    with pytest.raises(HybridPatternError) as err:
        parse_hybrid_pattern("M*x-")
    message = str(err.value)
    assert "invalid character 'x' at index 2 of hybrid layer pattern 'M*x-'" in message
    assert "accepted: 'M' (Mamba), '*' (attention), '-' (MLP), 'E' (MoE), '|' (pipeline stage boundary)" in message
    assert message.endswith("\n    M*x-\n      ^")
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ValueError)


def test_moe_layers_need_num_moe_experts():
    assert parse_hybrid_pattern("M*|-E").layers == "M*-E"
    assert resolve_hybrid_pattern(4, None, "M*|-E", num_moe_experts=4).layers == "M*-E"
    with pytest.raises(HybridPatternError) as err:
        resolve_hybrid_pattern(4, None, "M*|-E")
    assert "MoE layer ('E') at index 4 of hybrid layer pattern 'M*|-E' needs config.num_moe_experts" in str(err.value)
    assert str(err.value).endswith("\n    M*|-E\n        ^")


@pytest.mark.parametrize(
    "pattern, index, what",
    [
        ("|M*", 0, "empty pipeline segment"),
        ("M*||-", 3, "empty pipeline segment"),
        ("M*|", 3, "empty pipeline segment"),
        ("M*/", 3, "empty MTP pattern"),
        ("M*/-//*", 5, "empty MTP pattern"),
    ],
)
def test_empty_segments_are_pointed_at(pattern, index, what):
    with pytest.raises(HybridPatternError) as err:
        parse_hybrid_pattern(pattern)
    assert f"{what} at index {index}" in str(err.value)
    assert str(err.value).endswith(f"\n    {pattern}\n    {' ' * index}^")


def test_stage_boundary_inside_mtp_pattern_is_rejected():
    with pytest.raises(HybridPatternError, match=r"pipeline stage boundary '\|' at index 5 is inside an MTP pattern"):
        parse_hybrid_pattern("M*-/*|-")


def test_non_string_pattern_is_rejected():
    with pytest.raises(HybridPatternError, match="must be a non-empty string, got ''"):
        parse_hybrid_pattern("")


def test_stages_get_their_segments_with_global_layer_numbers():
    parsed = parse_hybrid_pattern("M*|--|*M|M-")
    assert select_stage_layers(parsed, 1, 0) == [
        (1, "M"),
        (2, "*"),
        (3, "-"),
        (4, "-"),
        (5, "*"),
        (6, "M"),
        (7, "M"),
        (8, "-"),
    ]
    assert select_stage_layers(parsed, 2, 0) == [(1, "M"), (2, "*"), (3, "-"), (4, "-")]
    assert select_stage_layers(parsed, 2, 1) == [(5, "*"), (6, "M"), (7, "M"), (8, "-")]
    assert select_stage_layers(parsed, 4, 3) == [(7, "M"), (8, "-")]
    with pytest.raises(HybridPatternError, match="pp_rank 2 is outside pipeline_model_parallel_size 2"):
        select_stage_layers(parsed, 2, 2)


def test_uneven_stage_split_says_so():
    parsed = parse_hybrid_pattern("M*|--|*M")
    with pytest.raises(HybridPatternError) as err:
        select_stage_layers(parsed, 2, 0)
    assert (
        "has 3 pipeline segment(s) separated by '|', which do not divide evenly among 2 pipeline stage(s); "
        "use a multiple of 2 segments"
    ) in str(err.value)
    with pytest.raises(HybridPatternError, match="divide evenly among 2 pipeline stage"):
        select_stage_layers(parse_hybrid_pattern("M*--"), 2, 1)


def test_ratio_allocation_spreads_each_kind():
    assert allocate_layer_pattern(4) == "MMMM"
    assert allocate_layer_pattern(8, attention_ratio=0.25) == "MM*MMM*M"
    pattern = allocate_layer_pattern(10, attention_ratio=0.2, mlp_ratio=0.4)
    assert len(pattern) == 10 and pattern.count("*") == 2 and pattern.count("-") == 4 and pattern.count("M") == 4
    with pytest.raises(
        HybridPatternError, match=r"hybrid_attention_ratio \(0.7\) \+ hybrid_mlp_ratio \(0.5\) must not exceed 1"
    ):
        allocate_layer_pattern(4, 0.7, 0.5)
    with pytest.raises(HybridPatternError, match=r"hybrid_mlp_ratio must be in \[0, 1\], got -0.1"):
        allocate_layer_pattern(4, 0.0, -0.1)


def test_resolve_checks_layer_and_mtp_counts():
    assert resolve_hybrid_pattern(4, None, "M*|--").layers == "M*--"
    assert resolve_hybrid_pattern(3, None, hybrid_override_pattern="M-*").layers == "M-*"
    assert resolve_hybrid_pattern(4, None, hybrid_attention_ratio=0.25).layers == "MM*M"
    assert resolve_hybrid_pattern(2, 1, "M*/-").mtp_patterns == ("-",)
    with pytest.raises(HybridPatternError, match=r"has 4 layers in its main part but config.num_layers is 5"):
        resolve_hybrid_pattern(5, None, "M*|--")
    with pytest.raises(HybridPatternError, match=r"has 1 MTP pattern\(s\) after '/' but config.mtp_num_layers is None"):
        resolve_hybrid_pattern(2, None, "M*/-")
    with pytest.raises(HybridPatternError, match="either hybrid_layer_pattern or hybrid_override_pattern, not both"):
        resolve_hybrid_pattern(2, None, "M*", hybrid_override_pattern="M*")
