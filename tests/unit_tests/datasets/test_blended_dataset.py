"""Weighted blends: --data-path parsing, the blended index against hand-computed counts and
order, blends of real indexed datasets (every sample comes from the dataset the index names,
in the given proportion), the index cache, size-weighted and per-split blends."""

import os

import numpy as np
import pytest

from megatron.core.datasets import (
    Blend,
    BlendedDataset,
    DatasetConfigError,
    GPTDataset,
    IndexedDatasetBuilder,
    blending_indices,
    build_blended_gpt_datasets,
    parse_blend,
)


def test_parse_blend_reads_megatrons_three_forms():
    assert parse_blend(["a_text_document"]) == Blend(("a_text_document",))
    assert parse_blend(["a", "b"]) == Blend(("a", "b"))
    assert parse_blend(["0.3", "a", "0.7", "b"]) == Blend(("a", "b"), (0.3, 0.7))
    assert parse_blend(["1", "a", "3", "b"]) == Blend(("a", "b"), (0.25, 0.75))


@pytest.mark.parametrize(
    "values,message",
    [
        (["0.3", "a", "0.7"], "takes weight-prefix pairs, got an odd number of entries"),
        (["0.3", "a", "x", "b"], "weights must be finite numbers >= 0 with a positive sum"),
        (["0", "a", "0", "b"], "weights must be finite numbers >= 0 with a positive sum"),
        (["a", "0.5"], "give either prefixes only or weight-prefix pairs"),
    ],
)
def test_bad_blends_are_refused_with_the_form_expected(values, message):
    with pytest.raises(DatasetConfigError, match=message):
        parse_blend(values)


def test_blending_order_and_counts_by_hand():
    # Weights 0.3 / 0.7: dataset 0's samples fall due at 0.5/0.3 = 1.67, 5, 8.33, 11.67, ...;
    # dataset 1's at 0.5/0.7 = 0.71, 2.14, 3.57, 5, 6.43, 7.86, 9.29, ...; the tie at 5 goes to
    # dataset 0 (although 1.5/0.3 rounds to just above 5 in floating point).
    dataset_index, sample_index = blending_indices([0.3, 0.7], 10)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 0, 1]
    assert sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 5, 2, 6]
    for size, counts in ((10, [3, 7]), (1000, [300, 700]), (7, [2, 5])):
        assert np.bincount(blending_indices([0.3, 0.7], size)[0]).tolist() == counts
    # Quarters: due times 2, 6, 10 | 0.67, 2, 3.33, 4.67, 6: ties to the lower index.
    assert blending_indices([0.25, 0.75], 8)[0].tolist() == [1, 0, 1, 1, 1, 0, 1, 1]


def test_every_prefix_of_a_blend_is_within_one_sample_of_its_share():
    weights = np.array([0.2, 0.5, 0.3])
    dataset_index, sample_index = blending_indices(weights, 5000)
    running = np.cumsum(np.eye(3, dtype=np.int64)[dataset_index], axis=0)
    shares = np.arange(1, 5001)[:, None] * weights
    assert np.abs(running - shares).max() < 1
    for d in range(3):  # each dataset's samples are taken in order, each once
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))


def _write(prefix, first_token, documents=60, length=9):
    """A dataset whose tokens all lie in [first_token, first_token + 100): samples say where they came from."""
    rng = np.random.default_rng(first_token)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        builder.add_document(rng.integers(first_token, first_token + 100, length))
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def two_datasets(tmp_path):
    return _write(tmp_path / "a_text_document", 0), _write(tmp_path / "b_text_document", 1000, documents=120)


def _source(sample) -> int:
    tokens = sample["tokens"].numpy()
    assert (tokens < 1000).all() or (tokens >= 1000).all()
    return int(tokens[0] >= 1000)


def test_a_weighted_blend_samples_its_datasets_in_the_given_proportion(two_datasets, tmp_path):
    a, b = two_datasets
    blend = parse_blend(["0.3", a, "0.7", b])
    cache = tmp_path / "cache"
    train, valid, test = build_blended_gpt_datasets(
        {"all": blend}, "1,0,0", [200, 0, 0], 8, seed=3, cache_dir=str(cache)
    )
    assert valid is None and test is None and isinstance(train, BlendedDataset)
    assert len(train) == 200 and train.counts() == [60, 140]
    assert [len(d) for d in train.datasets] == [60, 140]  # each built with exactly what the blend takes
    assert [_source(train[i]) for i in range(len(train))] == train.dataset_index.tolist()
    assert "a_text_document (weight 0.3): 60 samples" in train.describe()
    # The index was cached; a second build reads it back (same arrays) instead of recomputing.
    (cached,) = [f for f in os.listdir(cache) if f.endswith(".npz")]
    again, _, _ = build_blended_gpt_datasets({"all": blend}, "1,0,0", [200, 0, 0], 8, seed=3, cache_dir=str(cache))
    assert [f for f in os.listdir(cache) if f.endswith(".npz")] == [cached]
    np.testing.assert_array_equal(again.dataset_index, train.dataset_index)
    with np.load(cache / cached) as stored:
        np.testing.assert_array_equal(stored["dataset_sample_index"], train.dataset_sample_index)


def test_prefixes_without_weights_are_weighted_by_size_and_split_by_documents(two_datasets):
    a, b = two_datasets
    # Split 2,1,0: a's train split is 40 documents of 9 tokens, b's 80.
    train, valid, _ = build_blended_gpt_datasets({"all": parse_blend([a, b])}, "2,1,0", [300, 30, 0], 8, seed=3)
    a_samples, b_samples = (40 * 9 - 1) // 8, (80 * 9 - 1) // 8  # one epoch of each train split
    assert train.weights == pytest.approx([a_samples / (a_samples + b_samples), b_samples / (a_samples + b_samples)])
    assert sum(train.counts()) == 300 and len(valid) == 30
    assert set(train.datasets[0].document_order.tolist()) == set(range(40))  # the first 2/3 of a's documents
    assert set(valid.datasets[0].document_order.tolist()) == set(range(40, 60))


def test_per_split_blends_use_every_document_of_their_datasets(two_datasets):
    a, b = two_datasets
    blends = {"train": parse_blend(["0.5", a, "0.5", b]), "valid": parse_blend([b])}
    train, valid, test = build_blended_gpt_datasets(blends, "969,30,1", [40, 10, 10], 8, seed=0)
    assert train.counts() == [20, 20] and test is None
    assert isinstance(valid, GPTDataset) and set(valid.document_order.tolist()) == set(range(120))


def test_a_blend_that_needs_an_empty_split_says_which(two_datasets):
    a, b = two_datasets
    with pytest.raises(DatasetConfigError, match="the valid split of .*a_text_document has no documents"):
        build_blended_gpt_datasets({"all": parse_blend(["0.5", a, "0.5", b])}, "1000,1,0", [8, 8, 0], 8, seed=0)
