"""megatron-preprocess-data (its script tools/preprocess_data.py as a subprocess, the
package module in process): JSONL in, Megatron-named .bin/.idx out with the expected ids."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.core.datasets import IndexedDataset
from megatron.core.datasets import preprocess_data as tool
from megatron.core.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import generated_sentences, train_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "preprocess_data.py"


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_end_to_end_with_hf_tokenizer_and_two_workers(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    train_tiny_tokenizer(tokenizer_dir)
    texts = generated_sentences(count=60, seed=3) + ["unicode: é 漢字 🙂"]
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--input",
            str(input_path),
            "--output-prefix",
            str(tmp_path / "out" / "corpus"),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(tokenizer_dir),
            "--append-eod",
            "--workers",
            "2",
            "--log-interval",
            "20",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "processed 20 documents" in result.stderr
    assert f"done: processed {len(texts)} documents" in result.stderr
    prefix = tmp_path / "out" / "corpus_text_document"
    dataset = IndexedDataset(prefix)
    tokenizer = HuggingFaceTokenizer(tokenizer_dir)
    assert dataset.num_documents == len(texts)
    for i, text in enumerate(texts):
        assert dataset[i].tolist() == tokenizer.tokenize(text) + [tokenizer.eod]
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_byte_level_default_writes_one_dataset_per_json_key(tmp_path):
    records = [{"text": "héllo", "title": "a"}, {"text": "", "title": "bb"}]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    (tmp_path / "in.jsonl").write_text(input_path.read_text() + "\n\n")  # blank lines are skipped
    args = ["--input", str(input_path), "--output-prefix", str(tmp_path / "p"), "--json-keys", "text", "title"]
    assert tool.main(args) == 0
    text, title = IndexedDataset(tmp_path / "p_text_document"), IndexedDataset(tmp_path / "p_title_document")
    assert [text[i].tolist() for i in range(2)] == [list("héllo".encode()), []]
    assert [title[i].tolist() for i in range(2)] == [[97], [98, 98]]
    assert ByteLevelTokenizer().eod not in text[0].tolist()


@pytest.mark.parametrize(
    "lines, message",
    [
        (
            ['{"text": "ok"}', '{"body": "x"}'],
            r"line 2 has no string field 'text' \(--json-keys\); its fields are \['body'\]",
        ),
        (['{"text": "ok"}', "", "{not json"], r"line 3 is not valid JSON"),
        (["[1, 2]"], r"line 1 is a JSON list; expected an object"),
    ],
)
def test_bad_lines_fail_naming_the_line_and_leave_no_files(tmp_path, capsys, lines, message):
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("\n".join(lines) + "\n")
    assert tool.main(["--input", str(input_path), "--output-prefix", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.startswith("megatron-preprocess-data: error: ")
    with pytest.raises(ValueError, match=message):
        tool.preprocess(tool.parse_args(["--input", str(input_path), "--output-prefix", str(tmp_path / "p")]))
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_bad_arguments_are_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tool.parse_args(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", "p"])
    assert f"--input {tmp_path / 'missing.jsonl'} not found" in capsys.readouterr().err
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(SystemExit):
        tool.parse_args(["--input", str(input_path), "--output-prefix", "p", "--workers", "0"])
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
