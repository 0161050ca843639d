"""GPT pre-training samples: fixed-length windows over shuffled documents of an indexed dataset.

The documents of a split are laid end to end, one seeded permutation per epoch, as many
epochs as the requested samples need. Sample ``k`` (before shuffling) is the window of
``sequence_length + 1`` tokens starting at token ``k * sequence_length`` of that stream, so
windows cross document boundaries and consecutive windows share one token (the last
label of one is the first input of the next). The sample order is shuffled with the
same seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron.core.datasets.errors import DatasetConfigError
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.split import SPLIT_NAMES, parse_split, split_document_ranges


def make_sample(window: np.ndarray, eod_id: int | None = None, eod_mask_loss: bool = False) -> dict:
    """The training dict of one window of ``s + 1`` tokens: ``tokens`` = window[:-1],
    ``labels`` = window[1:], ``loss_mask`` (float, 0 where the input is EOD when
    ``eod_mask_loss``), ``position_ids`` = 0..s-1; each of shape [s]."""
    window = torch.from_numpy(np.asarray(window, dtype=np.int64))
    tokens, labels = window[:-1].contiguous(), window[1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        if eod_id is None:
            raise DatasetConfigError("--eod-mask-loss needs the tokenizer's end-of-document id (eod_id)")
        loss_mask[tokens == eod_id] = 0.0
    position_ids = torch.arange(tokens.numel(), dtype=torch.int64)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` windows of ``sequence_length + 1`` tokens over ``document_ids`` of
    ``indexed_dataset``, deterministic for a given ``seed``."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        document_ids: Sequence[int] | np.ndarray,
        num_samples: int,
        sequence_length: int,
        seed: int,
        eod_id: int | None = None,
        eod_mask_loss: bool = False,
    ):
        if sequence_length < 1:
            raise DatasetConfigError(f"--seq-length must be >= 1, got {sequence_length}")
        if num_samples < 1:
            raise DatasetConfigError(f"a GPT dataset needs at least 1 sample, got num_samples={num_samples}")
        self.indexed_dataset = indexed_dataset
        self.sequence_length = sequence_length
        self.num_samples = num_samples
        self.eod_id = eod_id
        self.eod_mask_loss = eod_mask_loss
        document_ids = np.asarray(document_ids, dtype=np.int64)
        lengths = indexed_dataset.document_lengths[document_ids]
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch == 0:
            raise DatasetConfigError(
                f"the {len(document_ids)} documents of this split hold no tokens; give more data "
                "(--data-path) or a larger share in --split"
            )
        tokens_needed = num_samples * sequence_length + 1
        self.num_epochs = -(-tokens_needed // tokens_per_epoch)
        document_rng = np.random.default_rng([seed, 0])
        self.document_order = np.concatenate([document_rng.permutation(document_ids) for _ in range(self.num_epochs)])
        order_lengths = indexed_dataset.document_lengths[self.document_order]
        self._document_starts = np.concatenate(([0], np.cumsum(order_lengths)[:-1]))
        self._document_offsets = indexed_dataset.document_token_offsets[self.document_order]
        self._order_lengths = order_lengths
        self.shuffle_index = np.random.default_rng([seed, 1]).permutation(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        """One line for the start-up summary: samples, documents, tokens, epochs, source."""
        documents = len(self.document_order) // self.num_epochs
        tokens = int(self._order_lengths.sum()) // self.num_epochs
        return (
            f"{self.num_samples} samples from {documents} documents ({tokens} tokens, {self.num_epochs} epoch"
            f"{'s' if self.num_epochs > 1 else ''}) of {self.indexed_dataset.path_prefix}"
        )

    def window(self, idx: int) -> np.ndarray:
        """The ``sequence_length + 1`` token ids of sample ``idx`` (after shuffling)."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample index {idx} out of range for {self.num_samples} samples")
        start = int(self.shuffle_index[idx]) * self.sequence_length
        remaining = self.sequence_length + 1
        position = int(np.searchsorted(self._document_starts, start, side="right")) - 1
        offset = start - int(self._document_starts[position])
        pieces = []
        while remaining:
            document_start = int(self._document_offsets[position]) + offset
            take = min(remaining, int(self._order_lengths[position]) - offset)
            pieces.append(self.indexed_dataset.tokens(document_start, document_start + take))
            remaining -= take
            position, offset = position + 1, 0
        return np.concatenate(pieces)

    def __getitem__(self, idx: int) -> dict:
        return make_sample(self.window(idx), self.eod_id, self.eod_mask_loss)


def build_gpt_datasets(
    data_prefix: str,
    split: str,
    num_samples: Sequence[int],
    sequence_length: int,
    seed: int,
    eod_id: int | None = None,
    eod_mask_loss: bool = False,
) -> list[GPTDataset | None]:
    """Train, valid and test :class:`GPTDataset` over one indexed dataset, its documents
    divided by ``split`` (``--split``); ``num_samples`` gives each split's sample count.

    A split with no samples requested, or a zero weight, is ``None``.
    """
    if len(num_samples) != len(SPLIT_NAMES):
        raise DatasetConfigError(
            f"num_samples needs one count per split ({', '.join(SPLIT_NAMES)}), got {list(num_samples)}"
        )
    indexed_dataset = IndexedDataset(data_prefix)
    weights = parse_split(split)
    ranges = split_document_ranges(indexed_dataset.num_documents, weights)
    datasets: list[GPTDataset | None] = []
    for name, weight, (start, stop), count in zip(SPLIT_NAMES, weights, ranges, num_samples, strict=True):
        if count == 0 or weight == 0:
            datasets.append(None)
            continue
        if start == stop:
            raise DatasetConfigError(
                f"--split {split!r} gives the {name} split no documents out of "
                f"{indexed_dataset.num_documents} in {data_prefix}, but {count} {name} samples are needed; "
                f"raise its share in --split or give more documents"
            )
        datasets.append(
            GPTDataset(indexed_dataset, np.arange(start, stop), count, sequence_length, seed, eod_id, eod_mask_loss)
        )
    return datasets
