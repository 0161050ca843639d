"""Dataset blends as Megatron's ``--data-path`` spells them: ``prefix``, ``prefix1 prefix2 ...``
(weighted by size) or ``weight1 prefix1 weight2 prefix2 ...``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.datasets.errors import DatasetConfigError


@dataclass(frozen=True)
class Blend:
    """Indexed-dataset prefixes and their normalized weights (None: weighted by each dataset's
    size, Megatron's rule for prefixes given without weights)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None

    def describe(self) -> str:
        if self.weights is None:
            return " ".join(self.prefixes)
        return " ".join(f"{w:.4g} {p}" for w, p in zip(self.weights, self.prefixes, strict=True))


def _weight(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def parse_blend(values: list[str], flag: str = "--data-path") -> Blend:
    """The blend ``values`` describe (the tokens after ``flag``). Weights must be finite, >= 0
    and not all 0; they are normalized to sum to 1."""
    if not values:
        raise DatasetConfigError(f"{flag} needs at least one dataset prefix")
    if len(values) == 1 or _weight(values[0]) is None:
        numeric = [v for v in values if _weight(v) is not None]
        if numeric and len(values) > 1:
            raise DatasetConfigError(
                f"{flag} {' '.join(values)}: give either prefixes only or weight-prefix pairs "
                f"(the first entry {values[0]!r} is not a weight, but {numeric[0]!r} is)"
            )
        return Blend(tuple(values))
    if len(values) % 2:
        raise DatasetConfigError(f"{flag} takes weight-prefix pairs, got an odd number of entries ({len(values)})")
    weights, prefixes = [_weight(v) for v in values[0::2]], values[1::2]
    bad = [values[2 * i] for i, w in enumerate(weights) if w is None or not math.isfinite(w) or w < 0]
    if bad or not sum(weights):
        raise DatasetConfigError(
            f"{flag} weights must be finite numbers >= 0 with a positive sum, got {values[0::2]} "
            f"(as in '{flag} 0.3 a_text_document 0.7 b_text_document')"
        )
    total = sum(weights)
    return Blend(tuple(prefixes), tuple(w / total for w in weights))
