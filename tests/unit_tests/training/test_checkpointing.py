"""Checkpointed training through the real loop: 10 steps + save + resume + 10 steps equals 20
straight steps exactly; --finetune / --no-load-optim; the config record rebuilds the model."""

import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import ACTIVATIONS, gelu_tanh, squared_relu
from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.dist_checkpointing import (
    TRACKER_FILENAME,
    iteration_dir,
    retire_iterations,
    write_latest_iteration,
)
from megatron.core.models.model_record import TokenizerRecord, load_model_weights, model_from_record, read_model_record
from megatron.training.arguments import model_record_from_args
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration
from tests.unit_tests.training.tiny_training import tiny_args, train_tiny

RUN = [
    "--num-layers",
    "2",
    "--lr-warmup-iters",
    "2",
    "--lr-decay-iters",
    "20",
    "--hidden-dropout",
    "0.1",
    "--eval-iters",
    "0",
    "--use-distributed-optimizer",
    "--log-interval",
    "100",
]


def _train(flags, world_size, metrics_jsonl=None):
    return train_tiny(RUN + flags, world_size=world_size, metrics_jsonl=metrics_jsonl)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """20 steps on DP2, saving at 10 and 20; returns the root and the 20 losses."""
    save = str(tmp_path_factory.mktemp("straight"))
    metrics = tmp_path_factory.mktemp("straight_metrics") / "metrics.jsonl"
    run_distributed(_train, 2, ["--train-iters", "20", "--save", save, "--save-interval", "10"], 2, metrics)
    return save, loss_curve(metrics)


def test_resume_reproduces_the_straight_run_exactly(straight_run, tmp_path):
    save, straight = straight_run
    write_latest_iteration(save, 10)
    try:
        flags = ["--train-iters", "20", "--load", save, "--save", str(tmp_path / "resumed")]
        iteration, consumed = run_distributed(_train, 2, flags, 2, tmp_path / "resumed.jsonl")[0]
    finally:
        write_latest_iteration(save, 20)
    assert (iteration, consumed) == (20, 160)
    assert len(straight) == 20
    resumed = losses_by_iteration(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(11, 21))  # it picks up at iteration 11
    assert [resumed[i] for i in range(11, 21)] == straight[10:]  # bit-identical to the straight run


def _padded_vocab_size(flags):
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import Trainer

    args = tiny_args(RUN + ["--train-iters", "1"] + flags)
    return Trainer(args, initialize_megatron(args)).model_chunks[0].module.padded_vocab_size


def test_make_vocab_size_divisible_by_sets_the_padding():
    assert run_distributed(_padded_vocab_size, 1, []) == [128]  # Megatron's default 128 x TP
    assert run_distributed(_padded_vocab_size, 1, ["--make-vocab-size-divisible-by", "1"]) == [64]
    assert run_distributed(_padded_vocab_size, 1, ["--make-vocab-size-divisible-by", "48"]) == [96]


def test_resume_with_another_vocabulary_padding_continues_the_run(straight_run, tmp_path):
    """Checkpoints hold the true vocabulary rows: a run padded to 128 rows resumes unpadded
    (--make-vocab-size-divisible-by 1, 64 rows) and continues the same loss curve."""
    save, straight = straight_run
    write_latest_iteration(save, 10)
    try:
        flags = ["--train-iters", "20", "--load", save, "--make-vocab-size-divisible-by", "1"]
        run_distributed(_train, 2, flags, 2, tmp_path / "unpadded.jsonl")
    finally:
        write_latest_iteration(save, 20)
    resumed = losses_by_iteration(tmp_path / "unpadded.jsonl")
    assert [resumed[i] for i in range(11, 21)] == pytest.approx(straight[10:], rel=1e-5)


def test_a_checkpoint_of_an_uneven_pipeline_resumes_under_another_layout(tmp_path):
    """Stage 0 with the embedding only, then DP2 from its checkpoint: the loss curve of a run
    that stays uneven throughout (layer numbers are global, so the split is the run's choice)."""
    uneven = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "0"]
    no_dropout = ["--hidden-dropout", "0.0"]
    straight = tmp_path / "straight.jsonl"
    run_distributed(_train, 2, ["--train-iters", "6", *uneven, *no_dropout], 2, straight)
    saved, resumed = tmp_path / "saved.jsonl", tmp_path / "resumed.jsonl"
    run_distributed(_train, 2, ["--train-iters", "3", "--save", str(tmp_path / "ck"), *uneven, *no_dropout], 2, saved)
    run_distributed(_train, 2, ["--train-iters", "6", "--load", str(tmp_path / "ck"), *no_dropout], 2, resumed)
    curve = losses_by_iteration(saved) | losses_by_iteration(resumed)
    assert [curve[i] for i in range(1, 7)] == pytest.approx(loss_curve(straight), rel=1e-5)


def test_save_retain_interval_keeps_the_newest_and_every_nth_checkpoint(tmp_path):
    root = tmp_path / "run"
    flags = ["--train-iters", "5", "--save", str(root), "--save-interval", "1", "--save-retain-interval", "2"]
    run_distributed(_train, 1, flags, 1)
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", "iter_0000005", TRACKER_FILENAME]
    (resumed,) = run_distributed(_train, 1, ["--train-iters", "6", "--load", str(root)], 1)
    assert resumed == (6, 48)  # the newest one is intact


def test_retire_iterations_leaves_the_tracked_one_and_newer_untracked_ones(tmp_path):
    for iteration in range(1, 8):
        os.makedirs(iteration_dir(str(tmp_path), iteration))
    write_latest_iteration(str(tmp_path), 5)  # 6 and 7: published, not tracked yet
    assert retire_iterations(str(tmp_path), 3) == [1, 2, 4]
    assert sorted(os.listdir(tmp_path)) == [*(f"iter_{i:07d}" for i in (3, 5, 6, 7)), TRACKER_FILENAME]


def test_finetune_loads_weights_only_and_no_load_optim_keeps_the_position(straight_run, tmp_path, capfd):
    save, straight = straight_run
    (fine,) = run_distributed(_train, 1, ["--train-iters", "1", "--load", save, "--finetune"], 1, tmp_path / "f.jsonl")
    assert fine == (1, 8)
    assert losses_by_iteration(tmp_path / "f.jsonl")[1] < straight[0] - 0.1  # starts from the trained weights
    flags = ["--train-iters", "21", "--load", save, "--no-load-optim"]
    (no_optim,) = run_distributed(_train, 1, flags, 1, tmp_path / "n.jsonl")
    assert no_optim == (21, 168) and sorted(losses_by_iteration(tmp_path / "n.jsonl")) == [21]
    out = capfd.readouterr().out
    loaded_lines = [line for line in out.splitlines() if line.startswith("loaded checkpoint")]
    assert loaded_lines[0].endswith(": model weights")
    assert loaded_lines[1].endswith(": model weights, train state (iteration 20, consumed samples 160), LR schedule")


def test_a_changed_schedule_needs_an_explicit_choice(straight_run):
    save, _ = straight_run
    with pytest.raises(Exception, match=r"--lr 0.001 \(checkpoint: 0.003\).*--override-opt-param-scheduler"):
        run_distributed(_train, 1, ["--train-iters", "21", "--load", save, "--lr", "1e-3"], 1)
    (overridden,) = run_distributed(
        _train, 1, ["--train-iters", "21", "--load", save, "--lr", "1e-3", "--override-opt-param-scheduler"], 1
    )
    assert overridden[0] == 21


def _logits_from_record(path):
    from megatron.core import parallel_state

    pg = parallel_state.initialize_model_parallel()
    model = model_from_record(read_model_record(path), pg, parallel_output=False).eval()
    before = model(torch.arange(16).unsqueeze(0) % 64)
    load_model_weights(model, path)
    return before, model(torch.arange(16).unsqueeze(0) % 64)


def _logits_from_flags(path, flags):
    from megatron.core import parallel_state

    args = tiny_args(RUN + flags)
    pg = parallel_state.initialize_model_parallel()
    model = model_from_record(model_record_from_args(args, 64), pg, parallel_output=False).eval()
    load_model_weights(model, path)
    return model(torch.arange(16).unsqueeze(0) % 64)


def test_config_record_rebuilds_the_model_without_flags(straight_run):
    save, _ = straight_run
    record = read_model_record(save)  # plain JSON, no process group in this process
    assert (record.family, record.spec, record.vocab_size) == ("gpt", "gpt_local", 64)
    assert record.share_embeddings_and_output_weights is True
    assert record.config.hidden_dropout == 0.1
    assert record.tokenizer == TokenizerRecord("ByteLevelTokenizer")
    ((before, rebuilt),) = run_distributed(_logits_from_record, 1, save)
    (reference,) = run_distributed(_logits_from_flags, 1, save, ["--train-iters", "20"])
    assert not torch.allclose(before, reference, atol=1e-3)
    torch.testing.assert_close(rebuilt, reference, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_config_dict_round_trips_every_activation(name):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, activation_func=ACTIVATIONS[name])
    data = config.to_dict()
    assert data["activation_func"] == name
    assert TransformerConfig.from_dict(data) == config


def test_registered_activations_compute_what_their_names_say():
    x = torch.linspace(-3, 3, 13)
    assert torch.equal(gelu_tanh(x), F.gelu(x, approximate="tanh"))
    assert torch.equal(squared_relu(x), torch.clamp(x, min=0) ** 2)


def test_unregistered_activation_cannot_be_saved_or_loaded():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, activation_func=torch.tanh)
    with pytest.raises(ConfigError, match="activation_func 'tanh' has no registered name"):
        config.to_dict()
    with pytest.raises(ConfigError, match="activation_func 'swish2' is unknown; known activations"):
        TransformerConfig.from_dict(
            {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "activation_func": "swish2"}
        )
