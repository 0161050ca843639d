"""Train/valid/test split of documents from a ``--split`` string such as ``"969,30,1"``."""

from __future__ import annotations

import re

import numpy as np

from megatron.core.datasets.errors import DatasetConfigError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """Normalized train/valid/test weights of ``split`` (``"969,30,1"``, ``"90/10"``, ``"1"``).

    Up to three non-negative numbers separated by ``,`` or ``/``; missing trailing entries
    are 0. Returns three weights that sum to 1.
    """
    parts = [part.strip() for part in re.split(r"[,/]", split)]
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) == 0:
        raise DatasetConfigError(
            f"--split {split!r} is invalid: expected 1 to 3 non-negative numbers separated by ',' or '/' "
            "with a positive sum, e.g. '969,30,1'"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` document ranges, one per weight, covering ``0..num_documents``.

    Boundaries are the cumulative weights times the document count, rounded, so the
    ranges never overlap and every document lands in exactly one split.
    """
    cumulative = np.concatenate(([0.0], np.cumsum(weights)))
    bounds = np.rint(cumulative / cumulative[-1] * num_documents).astype(np.int64)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(weights))]
