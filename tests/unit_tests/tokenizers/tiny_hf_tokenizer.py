"""Train a tiny byte-level BPE tokenizer.json on generated text (no downloads), for tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"
BOS = "<s>"
PAD = "<pad>"


def generated_sentences(count: int = 400, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English sentences over a small word list."""
    words = "the cat dog sat on a mat ran fast slow red blue tree house river token model".split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "." for _ in range(count)]


def train_tiny_tokenizer(
    directory: Path,
    vocab_size: int = 320,
    config: dict | None = None,
    special_tokens: tuple[str, ...] = (EOS, BOS, PAD),
) -> Path:
    """Write ``directory/tokenizer.json`` (and ``tokenizer_config.json`` when ``config`` is
    given) and return the tokenizer.json path. Special tokens get ids 0, 1, 2, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generated_sentences(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def train_tiny_gpt2_files(directory: Path, vocab_size: int = 320) -> tuple[Path, Path]:
    """GPT-2-format ``vocab.json`` and ``merges.txt`` (byte-level BPE with ``<|endoftext|>``),
    trained on generated text; returns their paths."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        generated_sentences(), vocab_size=vocab_size, special_tokens=[EOS], show_progress=False
    )
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tokenizer.save_model(str(directory))
    return Path(vocab), Path(merges)


def train_tiny_sentencepiece(directory: Path, vocab_size: int = 64) -> Path:
    """A SentencePiece BPE ``tokenizer.model`` trained on generated text."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(generated_sentences()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        minloglevel=2,
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path
