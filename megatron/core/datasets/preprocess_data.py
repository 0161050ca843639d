"""``megatron-preprocess-data``: tokenize a JSONL file into Megatron indexed datasets, one per
JSON key (``python -m megatron.core.datasets.preprocess_data``, ``python tools/preprocess_data.py``).

    megatron-preprocess-data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --append-eod --workers 2

writes ``data/corpus_text_document.bin`` and ``.idx`` (``--data-path data/corpus_text_document``
reads them). Each non-blank input line is one JSON object; each ``--json-keys`` entry of it is
one document.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator

from megatron.core.datasets.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from megatron.core.errors import MegatronInputError
from megatron.core.tokenizers import DEFAULT_TOKENIZER_TYPE, TOKENIZER_TYPES, build_tokenizer

PROG = "megatron-preprocess-data"


class PreprocessError(MegatronInputError):
    """An input line that cannot be turned into documents; the message names the line."""


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    """Megatron's naming: ``PREFIX_<key>_document``."""
    return f"{output_prefix}_{key}_document"


class DocumentEncoder:
    """Turns one JSONL line into token ids per key; built once per worker process."""

    def __init__(self, args: argparse.Namespace):
        self.tokenizer_args = tokenizer_args(args)
        self.json_keys = args.json_keys
        self.append_eod = args.append_eod
        self.tokenizer = None

    def initialize(self) -> None:
        self.tokenizer = build_tokenizer(**self.tokenizer_args)

    def encode(self, numbered_line: tuple[int, str]) -> tuple[dict[str, list[int]], int]:
        """Token ids of each key of line ``number``, and the line's size in bytes."""
        number, line = numbered_line
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PreprocessError(f"line {number} is not valid JSON: {exc}") from None
        if not isinstance(record, dict):
            raise PreprocessError(f"line {number} is a JSON {type(record).__name__}; expected an object")
        ids = {}
        for key in self.json_keys:
            if not isinstance(record.get(key), str):
                raise PreprocessError(
                    f"line {number} has no string field {key!r} (--json-keys); its fields are {sorted(record)}"
                )
            ids[key] = self.tokenizer.tokenize(record[key])
            if self.append_eod:
                ids[key].append(self.tokenizer.eod)
        return ids, len(line.encode("utf-8"))


def tokenizer_args(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``build_tokenizer`` that the tokenizer flags give."""
    return {
        "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": args.tokenizer_model,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
        "vocab_size": args.vocab_size,
    }


_worker_encoder: DocumentEncoder | None = None


def _init_worker(encoder: DocumentEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder
    _worker_encoder.initialize()


def _encode_in_worker(numbered_line: tuple[int, str]):
    return _worker_encoder.encode(numbered_line)


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """Non-blank lines of ``path`` with their 1-based line numbers."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def encoded_documents(args: argparse.Namespace) -> Iterable[tuple[dict[str, list[int]], int]]:
    """Encoded lines in input order, on ``args.workers`` processes when more than one."""
    encoder = DocumentEncoder(args)
    if args.workers == 1:
        encoder.initialize()
        yield from map(encoder.encode, numbered_lines(args.input))
        return
    with multiprocessing.get_context("fork").Pool(args.workers, _init_worker, (encoder,)) as pool:
        yield from pool.imap(_encode_in_worker, numbered_lines(args.input), chunksize=32)


def preprocess(args: argparse.Namespace) -> list[str]:
    """Write one indexed dataset per JSON key; returns their prefixes.

    Files are written under temporary names and renamed once complete, so a failure
    leaves no partial dataset behind.
    """
    vocab_size = build_tokenizer(**tokenizer_args(args)).vocab_size
    prefixes = {key: output_prefix_for_key(args.output_prefix, key) for key in args.json_keys}
    temporary = {key: f"{prefix}.tmp{os.getpid()}" for key, prefix in prefixes.items()}
    directory = os.path.dirname(args.output_prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    builders = {
        key: IndexedDatasetBuilder(data_file_path(prefix), dtype=optimal_dtype(vocab_size))
        for key, prefix in temporary.items()
    }
    try:
        start = time.monotonic()
        documents = total_bytes = 0
        for ids, num_bytes in encoded_documents(args):
            for key, builder in builders.items():
                builder.add_document(ids[key])
            documents += 1
            total_bytes += num_bytes
            if documents % args.log_interval == 0:
                _report_progress(documents, total_bytes, start)
        for key, builder in builders.items():
            builder.finalize(index_file_path(temporary[key]))
            os.replace(data_file_path(temporary[key]), data_file_path(prefixes[key]))
            os.replace(index_file_path(temporary[key]), index_file_path(prefixes[key]))
    finally:
        for key, builder in builders.items():
            builder.close()
            for path in (data_file_path(temporary[key]), index_file_path(temporary[key])):
                if os.path.exists(path):
                    os.remove(path)
    _report_progress(documents, total_bytes, start, done=True)
    return list(prefixes.values())


def _report_progress(documents: int, total_bytes: int, start: float, done: bool = False) -> None:
    elapsed = max(time.monotonic() - start, 1e-9)
    print(
        f"{'done: ' if done else ''}processed {documents} documents "
        f"({documents / elapsed:.1f} docs/s, {total_bytes / elapsed / 1e6:.2f} MB/s)",
        file=sys.stderr,
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    parser.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE, choices=TOKENIZER_TYPES)
    parser.add_argument(
        "--tokenizer-model", default=None, help="tokenizer.json or its directory; a SentencePiece .model file"
    )
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: the number of ids")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize (default: text)")
    parser.add_argument("--append-eod", action="store_true", help="append the EOD id to every document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input} not found")
    return args


def main(argv: list[str] | None = None) -> int:
    """``megatron-preprocess-data``; a bad input line is one line on stderr, exit status 2."""
    args = parse_args(argv)
    try:
        prefixes = preprocess(args)
    except ValueError as exc:  # PreprocessError, TokenizerError, IndexedDatasetError
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for prefix in prefixes:
        print(f"wrote {data_file_path(prefix)} and {index_file_path(prefix)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
