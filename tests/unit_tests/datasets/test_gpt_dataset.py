"""GPT samples against hand-built concatenations; seeded order; splits; mock data."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron.core.datasets import (
    DatasetConfigError,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    MockGPTDataset,
    build_gpt_datasets,
    build_mock_gpt_datasets,
    parse_split,
    split_document_ranges,
)


def write_corpus(prefix, documents):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(document)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def all_windows(dataset):
    return [dataset.window(i).tolist() for i in range(len(dataset))]


def test_single_document_windows_cross_epochs_as_computed_by_hand(tmp_path):
    # 5 tokens per epoch; 3 samples of 3+1 tokens need 10 tokens -> 2 epochs:
    # stream 0 1 2 3 4 0 1 2 3 4, windows start at 0, 3, 6 and overlap by one token.
    dataset = GPTDataset(IndexedDataset(write_corpus(tmp_path / "c", [[0, 1, 2, 3, 4]])), [0], 3, 3, seed=5)
    assert dataset.num_epochs == 2
    assert sorted(all_windows(dataset)) == [[0, 1, 2, 3], [1, 2, 3, 4], [3, 4, 0, 1]]


def test_samples_equal_the_concatenation_of_documents_in_shuffled_order(tmp_path):
    documents = [[1, 2, 3], [10, 11], [20, 21, 22, 23], [30], [40, 41, 42]]
    dataset = GPTDataset(IndexedDataset(write_corpus(tmp_path / "c", documents)), range(5), 9, 4, seed=3)
    # 13 tokens per epoch, 9 * 4 + 1 = 37 needed -> 3 epochs, each a permutation of all documents.
    assert dataset.num_epochs == 3
    order = dataset.document_order.tolist()
    assert [sorted(order[e * 5 : (e + 1) * 5]) for e in range(3)] == [list(range(5))] * 3
    stream = [token for d in order for token in documents[d]]
    raw_windows = [stream[k * 4 : k * 4 + 5] for k in range(9)]
    assert sorted(map(tuple, all_windows(dataset))) == sorted(map(tuple, raw_windows))
    assert all_windows(dataset) == [raw_windows[k] for k in dataset.shuffle_index]


def test_sample_dict_shifts_labels_and_masks_eod(tmp_path):
    eod = 99
    documents = [[1, 2, eod], [3, 4, 5, eod]]
    dataset = GPTDataset(
        IndexedDataset(write_corpus(tmp_path / "c", documents)), [0, 1], 1, 6, seed=0, eod_id=eod, eod_mask_loss=True
    )
    window = dataset.window(0)
    sample = dataset[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].tolist() == window[:-1].tolist()
    assert sample["labels"].tolist() == window[1:].tolist()
    assert sample["position_ids"].tolist() == list(range(6))
    assert sample["loss_mask"].tolist() == [0.0 if t == eod else 1.0 for t in window[:-1]]
    assert sample["tokens"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.float32
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=1)))
    assert batch["tokens"].shape == (1, 6)


def test_same_seed_same_order_different_seed_different_order(tmp_path):
    documents = [[d * 10 + i for i in range(d % 4 + 2)] for d in range(30)]
    indexed = IndexedDataset(write_corpus(tmp_path / "c", documents))
    first, again, other = (GPTDataset(indexed, range(30), 40, 8, seed=s) for s in (7, 7, 8))
    assert all_windows(first) == all_windows(again)
    assert all_windows(first) != all_windows(other)
    assert not np.array_equal(first.document_order, other.document_order)


def test_split_string_parsing():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("90/10") == pytest.approx([0.9, 0.1, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("a,b", "1,2,3,4", "0,0", "-1,2", "", "nan,1"):
        with pytest.raises(DatasetConfigError, match=r"--split .* is invalid: expected 1 to 3 non-negative numbers"):
            parse_split(bad)


@given(st.integers(0, 5000), st.lists(st.integers(0, 1000), min_size=1, max_size=3).filter(lambda w: sum(w) > 0))
def test_split_ranges_cover_every_document_once_in_proportion(num_documents, raw_weights):
    weights = parse_split(",".join(map(str, raw_weights)))
    ranges = split_document_ranges(num_documents, weights)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_documents
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    for (start, stop), weight in zip(ranges, weights, strict=True):
        # Each bound is within half a document of its exact place, so a range within one document
        # of its share; the share itself is a float (1 exactly can read 1.0000000000000284).
        assert abs((stop - start) - weight * num_documents) <= 1 + 1e-9


def test_build_gpt_datasets_divides_documents_by_split(tmp_path):
    documents = [[d, d + 1000] for d in range(100)]
    prefix = write_corpus(tmp_path / "c", documents)
    train, valid, test = build_gpt_datasets(prefix, "70,20,10", [50, 5, 5], 4, seed=1)
    for dataset, (start, stop) in zip((train, valid, test), [(0, 70), (70, 90), (90, 100)], strict=True):
        assert sorted(set(dataset.document_order.tolist())) == list(range(start, stop))
        first_tokens = {t for w in all_windows(dataset) for t in w if t < 1000}
        assert first_tokens <= set(range(start, stop))


def test_build_gpt_datasets_skips_unused_splits_and_explains_empty_ones(tmp_path):
    prefix = write_corpus(tmp_path / "c", [[1, 2, 3]] * 10)
    train, valid, test = build_gpt_datasets(prefix, "100,0,0", [4, 2, 0], 2, seed=1)
    assert train is not None and valid is None and test is None
    with pytest.raises(
        DatasetConfigError, match=r"--split '98,1,1' gives the valid split no documents out of 10 .* 2 valid samples"
    ):
        build_gpt_datasets(prefix, "98,1,1", [4, 2, 0], 2, seed=1)
    with pytest.raises(DatasetConfigError, match=r"num_samples needs one count per split \(train, valid, test\)"):
        build_gpt_datasets(prefix, "1", [4], 2, seed=1)


def test_gpt_dataset_argument_errors(tmp_path):
    indexed = IndexedDataset(write_corpus(tmp_path / "c", [[], [1]]))
    with pytest.raises(DatasetConfigError, match=r"--seq-length must be >= 1, got 0"):
        GPTDataset(indexed, [1], 1, 0, seed=0)
    with pytest.raises(DatasetConfigError, match=r"the 1 documents of this split hold no tokens"):
        GPTDataset(indexed, [0], 1, 4, seed=0)
    with pytest.raises(DatasetConfigError, match=r"--eod-mask-loss needs the tokenizer's end-of-document id"):
        GPTDataset(indexed, [1], 1, 2, seed=0, eod_mask_loss=True)[0]


# ---- mock data ----------------------------------------------------------------------------------


def test_mock_samples_are_arithmetic_sequences_modulo_vocab():
    dataset = MockGPTDataset(num_samples=20, sequence_length=16, vocab_size=50, seed=3)
    for i in range(len(dataset)):
        window = dataset.window(i)
        steps = set(np.diff(window) % 50)
        assert len(steps) == 1 and 1 <= steps.pop() <= 7
        assert window.min() >= 0 and window.max() < 50
        sample = dataset[i]
        assert sample["labels"].tolist() == window[1:].tolist()
        assert sample["loss_mask"].tolist() == [1.0] * 16


def test_mock_data_is_deterministic_and_splits_differ():
    train, valid, test = build_mock_gpt_datasets([8, 4, 0], 8, 259, seed=1)
    assert test is None
    again = MockGPTDataset(8, 8, 259, seed=1, split_id=0)
    assert all_windows(train) == all_windows(again)
    assert all_windows(valid) != all_windows(train)[:4]
    assert all_windows(MockGPTDataset(8, 8, 259, seed=2)) != all_windows(train)
    with pytest.raises(DatasetConfigError, match=r"vocabulary of more than 7 ids, got 5"):
        MockGPTDataset(1, 8, 5, seed=1)
