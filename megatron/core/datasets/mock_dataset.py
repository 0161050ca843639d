"""Synthetic GPT samples for --mock-data: arithmetic sequences modulo the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron.core.datasets.errors import DatasetConfigError
from megatron.core.datasets.gpt_dataset import make_sample
from megatron.core.datasets.split import SPLIT_NAMES

MAX_STEP = 7


class MockGPTDataset(torch.utils.data.Dataset):
    """Sample ``i`` is ``(start + step * t) mod vocab_size`` for ``t = 0..sequence_length``,
    with ``start`` and ``step`` (1..7) drawn from a generator seeded by ``(seed, split_id, i)``.

    Each token after the second is a function of the two before it, so a model can learn
    the data (its loss falls well below ``log(vocab_size)``), and samples never depend on
    how many were asked for.
    """

    def __init__(self, num_samples: int, sequence_length: int, vocab_size: int, seed: int, split_id: int = 0):
        if num_samples < 1 or sequence_length < 1:
            raise DatasetConfigError(
                f"mock data needs num_samples >= 1 and --seq-length >= 1, got {num_samples} and {sequence_length}"
            )
        if vocab_size <= MAX_STEP:
            raise DatasetConfigError(f"mock data needs a vocabulary of more than {MAX_STEP} ids, got {vocab_size}")
        self.num_samples = num_samples
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.split_id = split_id

    def __len__(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        return f"{self.num_samples} mock samples (vocabulary {self.vocab_size})"

    def window(self, idx: int) -> np.ndarray:
        """The ``sequence_length + 1`` token ids of sample ``idx``."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample index {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, self.split_id, idx])
        start = int(rng.integers(self.vocab_size))
        step = int(rng.integers(1, MAX_STEP + 1))
        return (start + step * np.arange(self.sequence_length + 1, dtype=np.int64)) % self.vocab_size

    def __getitem__(self, idx: int) -> dict:
        return make_sample(self.window(idx))


def build_mock_gpt_datasets(
    num_samples: Sequence[int], sequence_length: int, vocab_size: int, seed: int
) -> list[MockGPTDataset | None]:
    """Train, valid and test mock datasets (``None`` where no samples are asked for); the
    splits draw from different streams so they never repeat each other's samples."""
    if len(num_samples) != len(SPLIT_NAMES):
        raise DatasetConfigError(
            f"num_samples needs one count per split ({', '.join(SPLIT_NAMES)}), got {list(num_samples)}"
        )
    return [
        MockGPTDataset(count, sequence_length, vocab_size, seed, split_id) if count else None
        for split_id, count in enumerate(num_samples)
    ]
