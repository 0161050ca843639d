"""Hybrid layer patterns: parsing, legacy ratio allocation, and per-stage layer selection.

A pattern is one character per layer: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE
(needs ``config.num_moe_experts``). ``|`` marks pipeline-stage boundaries in the main pattern, and ``/`` starts each
multi-token-prediction (MTP) pattern after it, e.g. ``"M*M-|M*M-/*-"``: two pipeline segments of
four layers and one MTP depth made of an attention and an MLP layer.

:func:`select_stage_layers` is the single place that decides which layers a pipeline stage
builds and their global (1-based) layer numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.config import ConfigError

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
STAGE_SEPARATOR, MTP_SEPARATOR = "|", "/"
LAYER_SYMBOLS = {MAMBA: "Mamba", ATTENTION: "attention", MLP: "MLP", MOE: "MoE"}
_ACCEPTED = (
    "accepted: 'M' (Mamba), '*' (attention), '-' (MLP), 'E' (MoE), '|' (pipeline stage boundary), "
    "'/' (starts an MTP pattern)"
)


class HybridPatternError(ConfigError):
    """A hybrid layer pattern that cannot be used; the message points at the offending place."""


def _pointing_at(pattern: str, index: int) -> str:
    return f"\n    {pattern}\n    {' ' * index}^"


@dataclass(frozen=True)
class HybridLayerPattern:
    """A parsed pattern: the main stack's segments (split at ``|``) and the MTP patterns."""

    pattern: str
    segments: tuple[str, ...]
    mtp_patterns: tuple[str, ...]

    @property
    def layers(self) -> str:
        """The main stack's layer symbols, in order, without stage boundaries."""
        return "".join(self.segments)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def parse_hybrid_pattern(pattern: str) -> HybridLayerPattern:
    """Parse and validate ``pattern``; HybridPatternError points at the offending character."""
    if not isinstance(pattern, str) or not pattern:
        raise HybridPatternError(f"hybrid layer pattern must be a non-empty string, got {pattern!r}")
    main_end = pattern.find(MTP_SEPARATOR)
    main_end = len(pattern) if main_end < 0 else main_end
    for index, char in enumerate(pattern):
        in_mtp = index > main_end
        if char == STAGE_SEPARATOR and in_mtp:
            raise HybridPatternError(
                f"pipeline stage boundary '|' at index {index} is inside an MTP pattern (after '/'); "
                f"stage boundaries belong to the main pattern" + _pointing_at(pattern, index)
            )
        if char not in LAYER_SYMBOLS and char not in (STAGE_SEPARATOR, MTP_SEPARATOR):
            raise HybridPatternError(
                f"invalid character {char!r} at index {index} of hybrid layer pattern {pattern!r}; {_ACCEPTED}"
                + _pointing_at(pattern, index)
            )
    segments = pattern[:main_end].split(STAGE_SEPARATOR)
    start = 0
    for segment in segments:
        if not segment:
            raise HybridPatternError(
                f"empty pipeline segment at index {start} of hybrid layer pattern {pattern!r}: every '|' must "
                f"separate non-empty runs of layers" + _pointing_at(pattern, start)
            )
        start += len(segment) + 1
    mtp_patterns = pattern[main_end + 1 :].split(MTP_SEPARATOR) if main_end < len(pattern) else []
    start = main_end + 1
    for mtp in mtp_patterns:
        if not mtp:
            raise HybridPatternError(
                f"empty MTP pattern at index {start} of hybrid layer pattern {pattern!r}: each '/' must be "
                f"followed by at least one layer" + _pointing_at(pattern, start)
            )
        start += len(mtp) + 1
    return HybridLayerPattern(pattern, tuple(segments), tuple(mtp_patterns))


def _spread(count: int, slots: int) -> list[int]:
    """``count`` indices in ``range(slots)``, evenly spaced (centred in equal shares)."""
    return [int((i + 0.5) * slots / count) for i in range(count)]


def allocate_layer_pattern(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0) -> str:
    """A pattern of ``num_layers`` layers with the given fractions of attention and MLP layers
    (rounded), each kind spread evenly; the rest are Mamba. Attention is placed first, MLP
    layers are spread over the remaining positions."""
    for name, ratio in (("hybrid_attention_ratio", attention_ratio), ("hybrid_mlp_ratio", mlp_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise HybridPatternError(f"{name} must be in [0, 1], got {ratio}")
    if attention_ratio + mlp_ratio > 1.0:
        raise HybridPatternError(
            f"hybrid_attention_ratio ({attention_ratio}) + hybrid_mlp_ratio ({mlp_ratio}) must not exceed 1"
        )
    layers = [MAMBA] * num_layers
    n_attention = round(num_layers * attention_ratio)
    for index in _spread(n_attention, num_layers) if n_attention else []:
        layers[index] = ATTENTION
    free = [i for i, symbol in enumerate(layers) if symbol == MAMBA]
    n_mlp = min(round(num_layers * mlp_ratio), len(free))
    for slot in _spread(n_mlp, len(free)) if n_mlp else []:
        layers[free[slot]] = MLP
    return "".join(layers)


def resolve_hybrid_pattern(
    num_layers: int,
    mtp_num_layers: int | None = None,
    hybrid_layer_pattern: str | None = None,
    hybrid_attention_ratio: float | None = None,
    hybrid_mlp_ratio: float | None = None,
    hybrid_override_pattern: str | None = None,
    num_moe_experts: int | None = None,
) -> HybridLayerPattern:
    """The model's pattern from HybridModel's arguments, checked against the config.

    ``hybrid_layer_pattern`` (may hold ``|`` and ``/``) and the legacy
    ``hybrid_override_pattern`` are alternatives; without either the pattern is allocated from
    the ratios (all Mamba by default). The main pattern must have ``num_layers`` layers and
    the MTP patterns must number ``mtp_num_layers`` (None counts as 0); MoE layers (``E``) need
    ``num_moe_experts``.
    """
    if hybrid_layer_pattern is not None and hybrid_override_pattern is not None:
        raise HybridPatternError(
            "give either hybrid_layer_pattern or hybrid_override_pattern, not both "
            f"(got {hybrid_layer_pattern!r} and {hybrid_override_pattern!r})"
        )
    text = hybrid_layer_pattern if hybrid_layer_pattern is not None else hybrid_override_pattern
    if text is None:
        text = allocate_layer_pattern(num_layers, hybrid_attention_ratio or 0.0, hybrid_mlp_ratio or 0.0)
    parsed = parse_hybrid_pattern(text)
    if parsed.num_layers != num_layers:
        raise HybridPatternError(
            f"hybrid layer pattern {text!r} has {parsed.num_layers} layers in its main part but "
            f"config.num_layers is {num_layers}; they must match"
        )
    expected_mtp = mtp_num_layers or 0
    if len(parsed.mtp_patterns) != expected_mtp:
        raise HybridPatternError(
            f"hybrid layer pattern {text!r} has {len(parsed.mtp_patterns)} MTP pattern(s) after '/' but "
            f"config.mtp_num_layers is {mtp_num_layers}; give one '/'-pattern per MTP depth"
        )
    if MOE in text and num_moe_experts is None:
        index = text.index(MOE)
        raise HybridPatternError(
            f"MoE layer ('E') at index {index} of hybrid layer pattern {text!r} needs config.num_moe_experts "
            "(--num-experts)" + _pointing_at(text, index)
        )
    return parsed


def select_stage_layers(
    parsed: HybridLayerPattern, pp_size: int, pp_rank: int, vp_size: int = 1, vp_stage: int = 0
) -> list[tuple[int, str]]:
    """``(global layer number, symbol)`` of every main-stack layer that model chunk ``vp_stage``
    of pipeline stage ``pp_rank`` builds: the ``|`` segments are dealt to the ``pp_size x vp_size``
    (virtual) stages in order, ``len(segments) / (pp_size x vp_size)`` consecutive segments each;
    chunk ``vp_stage`` of rank ``pp_rank`` is virtual stage ``vp_stage * pp_size + pp_rank``.
    Layer numbers are 1-based over the whole main pattern.
    """
    num_stages = pp_size * vp_size
    if len(parsed.segments) % num_stages:
        stages = f"{pp_size} pipeline stage(s)" + (f" x {vp_size} virtual stages" if vp_size > 1 else "")
        raise HybridPatternError(
            f"hybrid layer pattern {parsed.pattern!r} has {len(parsed.segments)} pipeline segment(s) separated "
            f"by '|', which do not divide evenly among {stages}; use a multiple of {num_stages} segments"
        )
    if not 0 <= pp_rank < pp_size:
        raise HybridPatternError(f"pp_rank {pp_rank} is outside pipeline_model_parallel_size {pp_size}")
    if not 0 <= vp_stage < vp_size:
        raise HybridPatternError(f"vp_stage {vp_stage} is outside virtual_pipeline_model_parallel_size {vp_size}")
    per_stage = len(parsed.segments) // num_stages
    stage = vp_stage * pp_size + pp_rank
    first_layer = 1 + sum(len(s) for s in parsed.segments[: stage * per_stage])
    mine = "".join(parsed.segments[stage * per_stage : (stage + 1) * per_stage])
    return [(first_layer + i, symbol) for i, symbol in enumerate(mine)]


def segment_for_pipeline(pattern: str, pp_size: int, override: str | None = None) -> tuple[str, str | None]:
    """The pattern to build ``pattern``'s model with at ``pp_size`` pipeline stages, and a
    sentence saying where the stage boundaries were put (None when nothing changed).

    ``override`` (e.g. ``--hybrid-layer-pattern``) places the boundaries itself: it must
    describe the same layers, in the same order, with the same MTP patterns. Without it, a
    pattern that has no ``|`` gets ``pp_size - 1`` boundaries balanced by layer count (earlier
    stages take the extra layer); a pattern with ``|`` is kept as it is.
    """
    parsed = parse_hybrid_pattern(pattern)
    if override is not None:
        wanted = parse_hybrid_pattern(override)
        if (wanted.layers, wanted.mtp_patterns) != (parsed.layers, parsed.mtp_patterns):
            raise HybridPatternError(
                f"hybrid layer pattern override {override!r} describes other layers than the model's {pattern!r}: "
                f"it must have the same layers {parsed.layers!r} (and MTP patterns), with '|' only placed differently"
            )
        if override == pattern:
            return pattern, None
        return override, f"hybrid layer pattern {pattern!r} re-segmented as {override!r} (as given)"
    if pp_size == 1 or len(parsed.segments) > 1:
        return pattern, None
    if parsed.num_layers < pp_size:
        raise HybridPatternError(
            f"hybrid layer pattern {pattern!r} has {parsed.num_layers} layers, fewer than the {pp_size} pipeline "
            "stages it should be split into"
        )
    base, extra = divmod(parsed.num_layers, pp_size)
    sizes = [base + (stage < extra) for stage in range(pp_size)]
    starts = [sum(sizes[:stage]) for stage in range(pp_size)]
    segments = [parsed.layers[start : start + size] for start, size in zip(starts, sizes, strict=True)]
    main = STAGE_SEPARATOR.join(segments)
    segmented = MTP_SEPARATOR.join([main, *parsed.mtp_patterns])
    return segmented, (
        f"hybrid layer pattern {pattern!r} has no '|': for {pp_size} pipeline stages it is split as "
        f"{segmented!r} (balanced by layer count: {sizes} layers per stage)"
    )
