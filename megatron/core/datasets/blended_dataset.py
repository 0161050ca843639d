"""Weighted blends of GPT datasets (Megatron's ``--data-path 0.3 a 0.7 b``).

The blended index decides, for every sample ``i``, which dataset it comes from and which of
that dataset's samples it is. It is deterministic and exact: the ``k``-th sample of dataset
``d`` (weight ``w_d``) is due at ``(k + 1/2) / w_d`` and the blend takes samples in the order
they fall due (ties, to within 2^-20, to the lower dataset index). Among the first ``n`` samples every dataset
then has ``n * w_d`` of them to within one, and exactly ``n * w_d`` when that is a whole
number whose next sample is strictly later than the others'. Each dataset is built with
exactly the number of samples the index takes from it. With ``cache_dir``
(``--data-cache-path``) the index is written there once and read back by later runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from megatron.core.datasets.blend import Blend
from megatron.core.datasets.errors import DatasetConfigError
from megatron.core.datasets.gpt_dataset import GPTDataset, build_gpt_datasets
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.split import SPLIT_NAMES, parse_split, split_document_ranges

INDEX_VERSION = 1
# Due times are compared on a grid of 2^-20, so that ties which rounding hides (1.5 / 0.3 is
# 5.000000000000001) still go to the lower dataset index.
_DUE_RESOLUTION = 2.0**20


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` of a blend of ``size`` samples (see the module
    docstring): sample ``i`` is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``."""
    weights = np.asarray(weights, dtype=np.float64)
    if size < 0 or not np.all(np.isfinite(weights)) or np.any(weights < 0) or not weights.sum():
        raise DatasetConfigError(f"a blend needs size >= 0 and weights >= 0 with a positive sum, got {list(weights)}")
    weights = weights / weights.sum()
    due, owner, ordinal = [], [], []
    for dataset, weight in enumerate(weights):
        if weight == 0:
            continue
        # The size-th due time is below size + len(weights) / 2: this many candidates suffice.
        count = math.ceil(size * weight + len(weights) / 2) + 2
        k = np.arange(count, dtype=np.int64)
        due.append(np.rint((k + 0.5) / weight * _DUE_RESOLUTION))
        owner.append(np.full(count, dataset, dtype=np.int32))
        ordinal.append(k)
    due, owner, ordinal = np.concatenate(due), np.concatenate(owner), np.concatenate(ordinal)
    order = np.lexsort((owner, due))[:size]
    return owner[order], ordinal[order]


def cached_blending_indices(
    weights: Sequence[float], size: int, cache_dir: str | None, description: dict
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`blending_indices`, stored in ``cache_dir`` under a name hashed from the weights,
    the size and ``description`` (what the blend is of). Any process may write it: the bytes
    are the same, and each is published by an atomic rename."""
    if cache_dir is None:
        return blending_indices(weights, size)
    key = json.dumps(
        {"version": INDEX_VERSION, "weights": [float(w) for w in weights], "size": size, **description}, sort_keys=True
    )
    path = os.path.join(cache_dir, f"blend_{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")
    if os.path.isfile(path):
        with np.load(path, allow_pickle=False) as stored:
            return stored["dataset_index"], stored["dataset_sample_index"]
    dataset_index, dataset_sample_index = blending_indices(weights, size)
    os.makedirs(cache_dir, exist_ok=True)
    key_path = path.removesuffix(".npz") + ".json"
    with open(f"{key_path}.{os.getpid()}.tmp", "w", encoding="utf-8") as f:
        f.write(key)
    os.replace(f"{key_path}.{os.getpid()}.tmp", key_path)
    with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
        np.savez(f, dataset_index=dataset_index, dataset_sample_index=dataset_sample_index)
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``len(dataset_index)`` samples drawn from ``datasets`` by a blended index."""

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset | None],
        names: Sequence[str],
        weights: Sequence[float],
        dataset_index: np.ndarray,
        dataset_sample_index: np.ndarray,
    ):
        self.datasets, self.names, self.weights = list(datasets), list(names), list(weights)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]

    def counts(self) -> list[int]:
        """How many of the blend's samples come from each dataset."""
        return np.bincount(self.dataset_index, minlength=len(self.datasets)).tolist()

    def describe(self) -> str:
        parts = [
            f"{name} (weight {weight:.4g}): {count} samples"
            for name, weight, count in zip(self.names, self.weights, self.counts(), strict=True)
        ]
        return f"{len(self)} samples blended from " + "; ".join(parts)


def _samples_per_epoch(dataset: IndexedDataset, documents: range, sequence_length: int) -> int:
    tokens = int(dataset.document_lengths[documents.start : documents.stop].sum())
    return max(0, (tokens - 1) // sequence_length)


def _blend_split(
    blend: Blend,
    datasets: list[IndexedDataset],
    documents: list[range],
    num_samples: int,
    split_name: str,
    sequence_length: int,
    seed: int,
    eod_id: int | None,
    eod_mask_loss: bool,
    cache_dir: str | None,
) -> BlendedDataset:
    weights = blend.weights
    if weights is None:  # Megatron: prefixes without weights are weighted by their size
        weights = [_samples_per_epoch(d, docs, sequence_length) for d, docs in zip(datasets, documents, strict=True)]
        if not sum(weights):
            raise DatasetConfigError(f"the {split_name} split of {blend.describe()} holds no full sample")
        weights = [w / sum(weights) for w in weights]
    description = {
        "prefixes": list(blend.prefixes),
        "documents": [[docs.start, docs.stop] for docs in documents],
        "split": split_name,
    }
    dataset_index, dataset_sample_index = cached_blending_indices(weights, num_samples, cache_dir, description)
    counts = np.bincount(dataset_index, minlength=len(datasets))
    members = []
    for prefix, dataset, docs, count in zip(blend.prefixes, datasets, documents, counts, strict=True):
        if count and not len(docs):
            raise DatasetConfigError(
                f"the {split_name} split of {prefix} has no documents but the blend takes {count} samples from it; "
                "raise its share in --split or give it more documents"
            )
        members.append(
            GPTDataset(
                dataset, np.arange(docs.start, docs.stop), int(count), sequence_length, seed, eod_id, eod_mask_loss
            )
            if count
            else None
        )
    return BlendedDataset(members, list(blend.prefixes), weights, dataset_index, dataset_sample_index)


def build_blended_gpt_datasets(
    blends: dict[str, Blend],
    split: str,
    num_samples: Sequence[int],
    sequence_length: int,
    seed: int,
    eod_id: int | None = None,
    eod_mask_loss: bool = False,
    cache_dir: str | None = None,
) -> list[GPTDataset | BlendedDataset | None]:
    """Train, valid and test datasets of ``blends``: either ``{"all": blend}`` (``--data-path``,
    each dataset's documents divided by ``split``) or per split (``{"train": ..., "valid": ...,
    "test": ...}``, ``--train-data-path`` etc.: every document of each dataset). A single
    prefix gives a plain :class:`GPTDataset`; a split without samples or blend is None."""
    if len(num_samples) != len(SPLIT_NAMES):
        raise DatasetConfigError(f"num_samples needs one count per split ({', '.join(SPLIT_NAMES)}), got {num_samples}")
    if "all" in blends:
        blend = blends["all"]
        if len(blend.prefixes) == 1:
            return build_gpt_datasets(
                blend.prefixes[0], split, num_samples, sequence_length, seed, eod_id, eod_mask_loss
            )
        weights = parse_split(split)
        indexed = [IndexedDataset(prefix) for prefix in blend.prefixes]
        ranges = [[range(*r) for r in split_document_ranges(d.num_documents, weights)] for d in indexed]
        per_split = {name: (blend, indexed, [r[i] for r in ranges]) for i, name in enumerate(SPLIT_NAMES) if weights[i]}
    else:
        per_split = {}
        for name in SPLIT_NAMES:
            if name in blends:
                indexed = [IndexedDataset(prefix) for prefix in blends[name].prefixes]
                per_split[name] = (blends[name], indexed, [range(d.num_documents) for d in indexed])
    datasets: list[GPTDataset | BlendedDataset | None] = []
    for name, count in zip(SPLIT_NAMES, num_samples, strict=True):
        if not count or name not in per_split:
            datasets.append(None)
            continue
        blend, indexed, documents = per_split[name]
        if len(blend.prefixes) == 1:
            dataset, docs = indexed[0], documents[0]
            datasets.append(
                GPTDataset(
                    dataset, np.arange(docs.start, docs.stop), count, sequence_length, seed, eod_id, eod_mask_loss
                )
            )
            continue
        datasets.append(
            _blend_split(
                blend, indexed, documents, count, name, sequence_length, seed, eod_id, eod_mask_loss, cache_dir
            )
        )
    return datasets
