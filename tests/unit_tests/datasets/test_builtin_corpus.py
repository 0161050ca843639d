"""The built-in corpus: stdlib source text, deterministic, cached, usable with the default split."""

import sysconfig
from pathlib import Path

from megatron.core.datasets import (
    IndexedDataset,
    build_builtin_corpus,
    build_gpt_datasets,
    builtin_documents,
    default_builtin_corpus_prefix,
)
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import train_tiny_tokenizer

SMALL = 60_000


def test_two_builds_are_byte_identical(tmp_path):
    tokenizer = ByteLevelTokenizer()
    first = build_builtin_corpus(tmp_path / "a" / "corpus", tokenizer, max_bytes=SMALL)
    second = build_builtin_corpus(tmp_path / "b" / "corpus", tokenizer, max_bytes=SMALL)
    for suffix in (".bin", ".idx"):
        assert Path(first + suffix).read_bytes() == Path(second + suffix).read_bytes()


def test_documents_are_the_sorted_stdlib_sources_followed_by_eod(tmp_path):
    tokenizer = ByteLevelTokenizer()
    dataset = IndexedDataset(build_builtin_corpus(tmp_path / "corpus", tokenizer, max_bytes=SMALL))
    first_file = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_text()
    first_document = dataset[0].tolist()
    assert first_document[-1] == tokenizer.eod
    assert first_file.startswith(tokenizer.detokenize(first_document[:-1]))
    text_bytes = int(dataset.sequence_lengths.sum()) - dataset.num_documents  # minus one EOD each
    assert SMALL - 4 <= text_bytes <= SMALL  # the cut may drop up to 3 bytes of a split character
    assert dataset.num_documents == len(builtin_documents(SMALL)) > 50


def test_second_build_reuses_the_cached_files_and_a_new_tokenizer_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_CACHE_DIR", str(tmp_path / "cache"))
    byte_level = ByteLevelTokenizer()
    prefix = build_builtin_corpus(None, byte_level, max_bytes=SMALL)
    assert prefix == str(default_builtin_corpus_prefix(byte_level))
    assert prefix.startswith(str(tmp_path / "cache" / "builtin_corpus" / "ByteLevelTokenizer_"))
    stamp = Path(prefix + ".bin").stat().st_mtime_ns
    assert build_builtin_corpus(None, byte_level, max_bytes=SMALL) == prefix
    assert Path(prefix + ".bin").stat().st_mtime_ns == stamp
    build_builtin_corpus(prefix, byte_level, max_bytes=SMALL // 2)  # different size: rebuilt in place
    assert IndexedDataset(prefix).sequence_lengths.sum() < SMALL // 2 + 1000

    train_tiny_tokenizer(tmp_path / "tok")
    hf = HuggingFaceTokenizer(tmp_path / "tok")
    hf_prefix = build_builtin_corpus(None, hf, max_bytes=SMALL)
    assert hf_prefix != prefix
    assert IndexedDataset(hf_prefix)[0].tolist() == hf.tokenize(builtin_documents(SMALL)[0]) + [hf.eod]


def test_default_size_corpus_fills_every_split_of_the_default_split_string(tmp_path):
    tokenizer = ByteLevelTokenizer()
    prefix = build_builtin_corpus(tmp_path / "corpus", tokenizer)
    datasets = build_gpt_datasets(prefix, "969,30,1", [100, 10, 10], 128, seed=1234, eod_id=tokenizer.eod)
    assert all(d is not None and len(d) for d in datasets)
    corpus = "\0".join(builtin_documents()).encode()
    window = datasets[0].window(0).tolist()
    pieces = bytes(t if t != tokenizer.eod else 0 for t in window).split(b"\0")
    assert all(piece in corpus for piece in pieces)  # stdlib text, cut only at document ends
