"""Megatron-LM's own example command lines (GPT-3 175B, Llama-3-8B, the Mamba hybrid), scaled
to tiny sizes, run unchanged otherwise: each script beside this file is launched with torchrun
as a subprocess on CPU and trains 5 iterations. The GPT-2 vocab.json / merges.txt and the
SentencePiece model are trained here on generated text (nothing is downloaded).

Each run prints the start-up summary before its first iteration, the compatibility notes of the
implementation flags, logs 5 iterations, evaluates, saves, and writes Megatron's TensorBoard
tags. The GPT-3 recipe trains in fp16 from Megatron's initial loss scale 2^32, so its 5
iterations overflow and are skipped while the scale halves after the hysteresis, as Megatron's
would.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
from pathlib import Path

import pytest

from megatron.core.datasets.preprocess_data import parse_args as preprocess_args
from megatron.core.datasets.preprocess_data import preprocess
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import (
    generated_sentences,
    train_tiny_gpt2_files,
    train_tiny_sentencepiece,
)

HERE = Path(__file__).parent
ROOT = HERE.parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(script: str, args: list[str], cwd: Path) -> str:
    """Run ``bash script args`` like a user (CUDA hidden, the checkout importable); its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        ["bash", str(HERE / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def _corpus(directory: Path, **tokenizer) -> str:
    """docs.jsonl of generated sentences, preprocessed with ``tokenizer``; the dataset prefix."""
    docs = directory / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in generated_sentences(count=600, seed=9)))
    flags = ["--input", str(docs), "--output-prefix", str(directory / "corpus"), "--append-eod"]
    for name, value in tokenizer.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    (prefix,) = preprocess(preprocess_args(flags))
    return prefix


def _scalars(directory: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _check_run(output: str, iterations: int = 5) -> None:
    first_iteration = output.index(" iteration        1/")
    for summary in ("> layout: world", "> tokens per step:", "> parameters: stage 0:", "> datasets:"):
        assert output.index(summary) < first_iteration, summary
    for i in range(1, iterations + 1):
        assert f" iteration        {i}/       {iterations} |" in output
    assert " validation loss at iteration 5 |" in output
    assert "saved checkpoint" in output


def test_gpt3_175b_example_trains_tp2_pp2_with_gpt2_bpe_files(tmp_path):
    vocab, merges = train_tiny_gpt2_files(tmp_path / "gpt2")
    data = _corpus(tmp_path, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    output = _run(
        "train_gpt3_175b_tiny.sh",
        [str(tmp_path / "ckpt"), str(tmp_path / "tb"), str(vocab), str(merges), data],
        tmp_path,
    )
    _check_run(output)
    assert "> layout: world 4 = TP 2 x GTP 1 x CP 1 x DP 1 x PP 2" in output
    assert "number of skipped iterations:   5 |" in output  # fp16 from 2^32: every step overflows
    assert "> global batch schedule: 2 from sample 0, 4 from sample 2" in output
    assert "consumed samples:            2 |" in output and "consumed samples:           18 |" in output
    scalars = _scalars(tmp_path / "tb")
    assert scalars["loss-scale"] == [2.0**32, 2.0**31, 2.0**30, 2.0**29, 2.0**28]  # hysteresis 2, then halving
    assert len(scalars["lm loss"]) == 5 and len(scalars["lm loss validation"]) == 2  # at 5 and after training
    record = json.loads((tmp_path / "ckpt" / "iter_0000005" / "model_config.json").read_text())
    assert record["tokenizer"] == {
        "type": "GPT2BPETokenizer",
        "model": None,
        "vocab_file": "tokenizer/vocab.json",
        "merge_file": "tokenizer/merges.txt",
    }


def test_llama3_8b_example_trains_on_mock_data_with_per_token_loss_in_bf16(tmp_path):
    output = _run("train_llama3_8b_tiny.sh", [str(tmp_path / "ckpt"), str(tmp_path / "tb")], tmp_path)
    _check_run(output)
    for note in ("--use-mcore-models:", "--cross-entropy-loss-fusion:"):
        assert f"note: {note}" in output
    assert "> tokens per step: 256 = global batch 4 x sequence 64" in output and "5 iterations = 20 samples" in output
    scalars = _scalars(tmp_path / "tb")
    assert len(scalars["lm loss"]) == 5
    # --lr-warmup-samples 2 and --lr-decay-samples 18 of a global batch of 4: warm-up ends at
    # iteration 0.5, the cosine decay at 4.5; each record holds the rate after its step.
    progress = [(i - 0.5) / 4.0 for i in range(1, 5)]
    expected = [1e-5 + 0.5 * (1 + math.cos(math.pi * p)) * (1.5e-4 - 1e-5) for p in progress] + [1e-5]
    assert scalars["learning-rate"] == pytest.approx(expected, rel=1e-6)
    assert {"grad-norm", "throughput", "mem-max-rss-bytes", "lm loss test"} <= set(scalars)


def test_mamba_hybrid_example_trains_with_a_sentencepiece_model(tmp_path):
    model = train_tiny_sentencepiece(tmp_path / "sp")
    data = _corpus(tmp_path, tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model)
    output = _run("train_mamba_hybrid_tiny.sh", [data, str(model)], tmp_path)
    _check_run(output)
    assert "note: --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec" in output
    assert "--load ./checkpoints: no checkpoint there yet; training from scratch" in output
    assert (tmp_path / "checkpoints" / "iter_0000005" / "tokenizer" / "tokenizer.model").is_file()
    assert len(_scalars(tmp_path / "tensorboard")["lm loss"]) == 5
