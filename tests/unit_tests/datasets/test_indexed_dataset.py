"""The .bin/.idx pair: byte layout checked by hand, exact read-back, memmap, clear failures."""

import pickle
import struct

import numpy as np
import pytest

from megatron.core.datasets import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, optimal_dtype

MAGIC = b"MMIDIDX\x00\x00"


def write_dataset(prefix, documents, dtype=np.uint16):
    """``documents``: list of lists of sequences."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in documents:
        for sequence in sequences:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def documents():
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 60000, size=n).tolist()] for n in (5, 1, 17, 0, 9)]
    docs.append([[7, 8, 9], [10], [11, 12]])  # one document of three sequences
    return docs


def test_files_follow_megatron_layout_byte_for_byte(tmp_path, documents):
    prefix = write_dataset(tmp_path / "d", documents)
    sequences = [s for doc in documents for s in doc]
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == MAGIC
    version, code, num_sequences, num_doc_indices = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, num_sequences, num_doc_indices) == (1, 8, 8, 7)  # 8 = uint16
    offset = 34
    lengths = np.frombuffer(raw, np.int32, 8, offset)
    pointers = np.frombuffer(raw, np.int64, 8, offset + 32)
    doc_indices = np.frombuffer(raw, np.int64, 7, offset + 96)
    assert len(raw) == offset + 96 + 56
    assert lengths.tolist() == [5, 1, 17, 0, 9, 3, 1, 2]
    assert pointers.tolist() == [0, 10, 12, 46, 46, 64, 70, 72]  # byte offsets, 2 bytes per token
    assert doc_indices.tolist() == [0, 1, 2, 3, 4, 5, 8]
    expected_bin = np.concatenate([np.asarray(s, dtype=np.uint16) for s in sequences]).tobytes()
    assert (tmp_path / "d.bin").read_bytes() == expected_bin
    dataset = IndexedDataset(prefix)
    assert dataset.sequence_lengths.tolist() == lengths.tolist()
    assert dataset.sequence_pointers.tolist() == pointers.tolist()
    assert dataset.document_indices.tolist() == doc_indices.tolist()


def test_reader_returns_every_sequence_exactly_from_a_memmap(tmp_path, documents):
    dataset = IndexedDataset(write_dataset(tmp_path / "d", documents))
    sequences = [s for doc in documents for s in doc]
    assert len(dataset) == len(sequences) and dataset.num_documents == len(documents)
    assert dataset.dtype == np.uint16
    for i, sequence in enumerate(sequences):
        assert dataset[i].tolist() == sequence
    assert isinstance(dataset[0], np.memmap)  # a view into the mapped file, not a copy
    assert dataset.get(2, offset=3, length=4).tolist() == sequences[2][3:7]
    assert dataset[-1].tolist() == [11, 12]
    assert dataset.document_lengths.tolist() == [5, 1, 17, 0, 9, 6]
    assert dataset.document_token_offsets.tolist() == [0, 5, 6, 23, 23, 32]
    assert dataset.tokens(32, 38).tolist() == [7, 8, 9, 10, 11, 12]


def test_reader_survives_pickling_by_reopening_the_files(tmp_path, documents):
    dataset = IndexedDataset(write_dataset(tmp_path / "d", documents))
    clone = pickle.loads(pickle.dumps(dataset))
    assert [clone[i].tolist() for i in range(len(clone))] == [dataset[i].tolist() for i in range(len(dataset))]


def test_add_document_splits_sequences_and_int32_is_chosen_for_large_vocabularies(tmp_path):
    assert optimal_dtype(259) == np.uint16 and optimal_dtype(65536) == np.uint16
    assert optimal_dtype(65537) == np.int32
    builder = IndexedDatasetBuilder(tmp_path / "d.bin", dtype=optimal_dtype(100_000))
    builder.add_document([99_999, 1, 2, 3], lengths=[1, 3])
    builder.add_document([5])
    builder.finalize(tmp_path / "d.idx")
    dataset = IndexedDataset(tmp_path / "d")
    assert dataset.dtype == np.int32
    assert [dataset[i].tolist() for i in range(3)] == [[99_999], [1, 2, 3], [5]]
    assert dataset.document_indices.tolist() == [0, 2, 3]


def test_empty_dataset_reads_back_empty(tmp_path):
    dataset = IndexedDataset(write_dataset(tmp_path / "d", []))
    assert len(dataset) == 0 and dataset.num_documents == 0


def test_builder_rejects_tokens_that_do_not_fit_the_dtype(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "d.bin", dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match=r"token ids span 0\.\.70000 but dtype uint16 holds 0\.\.65535"):
        builder.add_item([0, 70000])
    with pytest.raises(IndexedDatasetError, match=r"do not add up to the 3 tokens"):
        builder.add_document([1, 2, 3], lengths=[1, 1])
    builder.close()
    with pytest.raises(IndexedDatasetError, match=r"dtype complex64 cannot be stored; accepted dtypes: uint8"):
        IndexedDatasetBuilder(tmp_path / "e.bin", dtype=np.complex64)


def corrupt(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def truncate(path, num_bytes):
    path.write_bytes(path.read_bytes()[:-num_bytes])


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: corrupt(p / "d.idx", 0, b"XXIDIDX"),
            r"is not a Megatron index file: expected it to start with magic",
        ),
        (lambda p: corrupt(p / "d.idx", 9, struct.pack("<Q", 2)), r"has index version 2; accepted version: 1"),
        (
            lambda p: corrupt(p / "d.idx", 17, bytes([42])),
            r"has dtype code 42; accepted codes: \[1, 2, 3, 4, 5, 6, 7, 8\]",
        ),
        (
            lambda p: truncate(p / "d.idx", 8),
            r"is 178 bytes but its header \(8 sequences, 7 document indices\) implies 186; the file is truncated",
        ),
        (
            lambda p: truncate(p / "d.bin", 2),
            r"describes 76 bytes of uint16; the \.bin and \.idx do not belong together",
        ),
        (
            lambda p: corrupt(p / "d.idx", 34, struct.pack("<i", 6)),
            r"sequence pointers that do not match its sequence lengths",
        ),
        (
            lambda p: corrupt(p / "d.idx", 34 + 96, struct.pack("<q", 1)),
            r"invalid document indices: they must start at 0",
        ),
        (
            lambda p: (p / "d.bin").unlink(),
            r"d\.bin not found: a dataset prefix PREFIX needs PREFIX\.bin and PREFIX\.idx",
        ),
        (lambda p: (p / "d.idx").write_bytes(b""), r"is not a Megatron index file"),
    ],
)
def test_bad_files_fail_clearly(tmp_path, documents, damage, message):
    write_dataset(tmp_path / "d", documents)
    damage(tmp_path)
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDataset(tmp_path / "d")
