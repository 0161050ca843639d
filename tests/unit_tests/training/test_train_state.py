"""TrainState holds a few counters and no loss history; checkpoints of earlier versions, whose
train state carries the whole loss list (``history``), still load and resume exactly."""

import dataclasses

import pytest

from megatron.core.dist_checkpointing import CheckpointingError, iteration_dir, load, write_latest_iteration
from megatron.training import checkpointing
from megatron.training.training import TrainState, pretrain
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import losses_by_iteration
from tests.unit_tests.training.test_checkpointing import RUN
from tests.unit_tests.training.tiny_training import tiny_args


def test_the_state_is_counters_only():
    assert [f.name for f in dataclasses.fields(TrainState)] == [
        "iteration",
        "consumed_samples",
        "skipped_iterations",
        "nan_iterations",
    ]


def test_a_saved_history_is_dropped_and_missing_or_unknown_fields_are_named():
    old = {"iteration": 3, "consumed_samples": 24, "skipped_iterations": 1, "nan_iterations": 0, "history": [1.0] * 3}
    assert TrainState.from_dict(old) == TrainState(3, 24, 1, 0)
    with pytest.raises(CheckpointingError) as err:
        TrainState.from_dict({"iteration": 3, "tokens_seen": 7, "wall_time": 1.0})
    assert str(err.value) == (
        "the checkpoint's train state lacks ['consumed_samples', 'skipped_iterations', 'nan_iterations'] and has "
        "unknown fields ['tokens_seen', 'wall_time']; this version reads "
        "['iteration', 'consumed_samples', 'skipped_iterations', 'nan_iterations']"
    )


def _save_like_earlier_versions(data, main):
    """What ``train_state_object`` got before TrainState dropped its history: the state plus
    every iteration's loss."""
    if data is not None:
        data = {**data, "history": [4.0 - 0.1 * i for i in range(data["iteration"])]}
    return _original_train_state_object(data, main)


_original_train_state_object = checkpointing.train_state_object


def _train(flags, metrics_jsonl, legacy_save=False):
    if legacy_save:  # this rank is a forked process: the patch dies with it
        checkpointing.train_state_object = _save_like_earlier_versions
    args = tiny_args(RUN + flags + ["--log-interval", "1", "--metrics-jsonl", metrics_jsonl])
    state = pretrain(args)
    return dataclasses.asdict(state)


def _saved_train_state(checkpoint_dir):
    return load({"train_state": checkpointing.train_state_object(None, True)}, checkpoint_dir)["train_state"]


def test_a_checkpoint_whose_train_state_holds_a_history_resumes_exactly(tmp_path):
    save = str(tmp_path / "old")
    straight_flags = ["--train-iters", "4", "--save", save, "--save-interval", "2"]
    run_distributed(_train, 1, straight_flags, str(tmp_path / "straight.jsonl"), True)
    (saved,) = run_distributed(_saved_train_state, 1, iteration_dir(save, 2))
    assert saved["history"] == [4.0, 3.9] and saved["iteration"] == 2  # the layout earlier versions wrote
    write_latest_iteration(save, 2)

    (resumed,) = run_distributed(_train, 1, ["--train-iters", "4", "--load", save], str(tmp_path / "resumed.jsonl"))
    assert resumed == {"iteration": 4, "consumed_samples": 32, "skipped_iterations": 0, "nan_iterations": 0}
    straight = losses_by_iteration(tmp_path / "straight.jsonl")
    assert losses_by_iteration(tmp_path / "resumed.jsonl") == {3: straight[3], 4: straight[4]}
