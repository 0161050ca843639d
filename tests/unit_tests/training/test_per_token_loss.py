"""--calculate-per-token-loss is exact: one training step at DP2, TP2xDP2 and PP2 moves the
weights by exactly the gradient of the global batch's token-mean loss, computed here in one
process by hand (sum of the unmasked per-token losses over all 8 samples / their count).

The data has many short documents and --eod-mask-loss, so micro-batches hold different
numbers of counted tokens: the token mean then differs from the mean of micro-batch means
that the default loss gives (checked too, so the comparison has teeth). SGD without momentum,
weight decay or clipping at lr 1 makes the step equal to minus the gradient.
"""

import numpy as np
import pytest
import torch

from megatron.core.datasets import IndexedDatasetBuilder
from megatron.core.models.model_record import load_model_weights, model_from_record, read_model_record
from megatron.training.arguments import model_record_from_args, parse_args
from megatron.training.data import build_datasets
from megatron.training.initialize import initialize_megatron
from megatron.training.training import pretrain
from tests.unit_tests.dist_harness import run_distributed

VOCAB, EOD = 64, 63  # NullTokenizer: the last id is end-of-document
GLOBAL_BATCH, MICRO_BATCH = 8, 2


def _flags(prefix: str) -> list[str]:
    return [
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"),
        *("--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", "1"),
        *("--lr", "1.0", "--lr-decay-style", "constant", "--optimizer", "sgd", "--sgd-momentum", "0"),
        *("--weight-decay", "0", "--clip-grad", "0", "--hidden-dropout", "0", "--attention-dropout", "0"),
        *("--eval-iters", "0", "--data-path", prefix, "--split", "1,0,0", "--eod-mask-loss"),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--distributed-backend", "gloo"),
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Short documents (1 to 5 tokens, then EOD): windows of 16 hold 3 to 8 EODs."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "short_text_document")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(200):
        builder.add_document([*rng.integers(0, EOD, rng.integers(1, 6)), EOD])
    builder.finalize(f"{prefix}.idx")
    return prefix


def _reference(flags):
    """Weights after one SGD step on the token-mean loss and on the mean of micro-batch means."""
    args = parse_args(flags, world_size=1)
    pgc = initialize_megatron(args)
    record = model_record_from_args(args, VOCAB)
    train, _, _ = build_datasets(args, record.tokenizer.build(), VOCAB)
    samples = [train[i] for i in range(GLOBAL_BATCH)]
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    results = {}
    for name in ("token_mean", "mean_of_means"):
        model = model_from_record(record, pgc)
        losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"]) * batch["loss_mask"]
        if name == "token_mean":
            loss = losses.sum() / batch["loss_mask"].sum()
        else:
            per_micro = losses.view(-1, MICRO_BATCH, losses.shape[-1]).sum((1, 2))
            loss = (per_micro / batch["loss_mask"].view(-1, MICRO_BATCH, losses.shape[-1]).sum((1, 2))).mean()
        loss.backward()
        results[name] = {n: (p - p.grad).detach() for n, p in model.named_parameters()}
    counts = batch["loss_mask"].view(-1, MICRO_BATCH * losses.shape[-1]).sum(1)
    return results, counts.tolist()


def _train(flags, world_size):
    pretrain(parse_args(flags, world_size=world_size))


def _weights(path):
    from megatron.core import parallel_state

    pg = parallel_state.initialize_model_parallel()
    model = model_from_record(read_model_record(path), pg)
    load_model_weights(model, path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(corpus):
    ((results, counts),) = run_distributed(_reference, 1, _flags(corpus))
    return results, counts


def test_the_data_makes_token_mean_and_mean_of_means_differ(reference):
    results, counts = reference
    assert len(set(counts)) > 1  # micro-batches count different numbers of tokens
    token_mean, mean_of_means = results["token_mean"], results["mean_of_means"]
    assert max((token_mean[n] - mean_of_means[n]).abs().max().item() for n in token_mean) > 1e-4


@pytest.mark.parametrize(
    "layout,world_size",
    [
        (["--use-distributed-optimizer"], 2),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
        (["--pipeline-model-parallel-size", "2"], 2),
    ],
    ids=["DP2", "TP2xDP2", "PP2"],
)
def test_per_token_loss_step_equals_the_single_process_token_mean_gradient(
    corpus, reference, layout, world_size, tmp_path
):
    save = str(tmp_path / "ckpt")
    flags = _flags(corpus) + layout + ["--calculate-per-token-loss", "--save", save]
    run_distributed(_train, world_size, flags, world_size)
    (weights,) = run_distributed(_weights, 1, save)
    expected = reference[0]["token_mean"]
    assert weights.keys() == expected.keys()
    for name in expected:
        rows = VOCAB if name == "embedding.word_embeddings.weight" else None  # checkpoints keep the true vocabulary
        torch.testing.assert_close(weights[name][:rows], expected[name][:rows], rtol=1e-5, atol=1e-6, msg=name)
