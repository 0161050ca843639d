"""A corpus that needs no download: the Python standard library's own source files.

Used when ``--data-path builtin`` is given (or neither a data path nor ``--mock-data``).
The text is read from a fixed, sorted list of the stdlib's top-level ``.py`` files (one
document per top-level statement or method) up to ``max_bytes``, tokenized and written as
an indexed dataset. The result is cached: a later call with the same text and tokenizer reuses the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path

import numpy as np

from megatron.core.datasets.errors import DatasetConfigError
from megatron.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from megatron.core.tokenizers.base import MegatronTokenizer

BUILTIN_DATA_PATH = "builtin"
DEFAULT_MAX_BYTES = 1_500_000
CACHE_DIR_ENV = "MEGATRON_CACHE_DIR"
_FORMAT_VERSION = 1
_BLOCK_BOUNDARY = re.compile(r"\n\n+(?=(?:    )?\S)")


def builtin_source_files() -> list[Path]:
    """The stdlib's top-level ``.py`` files, sorted by name."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def builtin_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """Blocks of :func:`builtin_source_files`, in order, at most ``max_bytes`` UTF-8 bytes in
    all (the last one cut at a character boundary). A block starts after a blank line at a
    top-level or once-indented line: a statement, function, class header or method.

    Splitting files into blocks gives thousands of documents, so that even a 0.1% test
    share of ``--split`` holds some.
    """
    if max_bytes < 1:
        raise DatasetConfigError(f"max_bytes must be >= 1, got {max_bytes}")
    documents, remaining = [], max_bytes
    for path in builtin_source_files():
        for block in _BLOCK_BOUNDARY.split(path.read_text(encoding="utf-8", errors="replace")):
            data = block.strip("\n").encode("utf-8")[:remaining]
            text = data.decode("utf-8", errors="ignore")
            if not text:
                continue
            documents.append(text)
            remaining -= len(data)
            if remaining <= 0:
                return documents
    return documents


def default_builtin_corpus_prefix(tokenizer: MegatronTokenizer) -> Path:
    """Cache location for ``tokenizer``'s corpus: ``$MEGATRON_CACHE_DIR`` (default
    ``~/.cache/megatron``) ``/builtin_corpus/<tokenizer>_<hash>_text_document``."""
    root = Path(os.environ.get(CACHE_DIR_ENV, "~/.cache/megatron")).expanduser()
    digest = hashlib.sha256(tokenizer.fingerprint().encode()).hexdigest()[:12]
    return root / "builtin_corpus" / f"{type(tokenizer).__name__}_{digest}_text_document"


def _manifest(documents: list[str], tokenizer: MegatronTokenizer, max_bytes: int) -> dict:
    text_hash = hashlib.sha256()
    for document in documents:
        text_hash.update(hashlib.sha256(document.encode()).digest())
    return {
        "format_version": _FORMAT_VERSION,
        "max_bytes": max_bytes,
        "num_documents": len(documents),
        "text_sha256": text_hash.hexdigest(),
        "tokenizer": tokenizer.fingerprint(),
    }


def _cached(prefix: str, manifest: dict) -> bool:
    manifest_path = Path(f"{prefix}.json")
    if not manifest_path.is_file() or json.loads(manifest_path.read_text()) != manifest:
        return False
    try:
        IndexedDataset(prefix)
    except IndexedDatasetError:
        return False
    return True


def build_builtin_corpus(
    output_prefix: str | os.PathLike | None,
    tokenizer: MegatronTokenizer,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> str:
    """Write the built-in corpus as ``PREFIX.bin``/``PREFIX.idx`` (each document followed by
    the tokenizer's EOD) and return ``PREFIX``, the value to read it with.

    ``output_prefix`` None means :func:`default_builtin_corpus_prefix`. When ``PREFIX.json``
    records the same text and tokenizer and the files load, nothing is rebuilt. Files are
    written under temporary names and renamed, so a concurrent reader never sees half a file.
    """
    prefix = os.fspath(default_builtin_corpus_prefix(tokenizer) if output_prefix is None else output_prefix)
    documents = builtin_documents(max_bytes)
    manifest = _manifest(documents, tokenizer, max_bytes)
    if _cached(prefix, manifest):
        return prefix
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    temporary = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(data_file_path(temporary), dtype=optimal_dtype(tokenizer.vocab_size))
    for document in documents:
        builder.add_document(np.asarray(tokenizer.tokenize(document) + [tokenizer.eod]))
    builder.finalize(index_file_path(temporary))
    os.replace(data_file_path(temporary), data_file_path(prefix))
    os.replace(index_file_path(temporary), index_file_path(prefix))
    Path(f"{temporary}.json").write_text(json.dumps(manifest, indent=1))
    os.replace(f"{temporary}.json", f"{prefix}.json")
    return prefix
