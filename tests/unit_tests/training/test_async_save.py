"""--async-save: training continues while a background thread writes the snapshot taken at the
save; that checkpoint is bit-identical to a synchronous save of the same run even when later
steps change the weights before anything is written; a failure of the writer stops training
at a later step with one clear error and leaves the last complete checkpoint in place."""

import threading

import torch

from megatron.core.dist_checkpointing import iteration_dir, read_latest_iteration, set_phase_hook, verify_checkpoint
from megatron.training.training import Trainer
from tests.unit_tests.dist_checkpointing.checkpoint_contents import assert_same_contents, everything_in
from tests.unit_tests.training.forked_training import train
from tests.unit_tests.training.loss_curve import losses_by_iteration


def _flags(root, metrics, *extra):
    return ["--train-iters", "6", "--save-interval", "2", "--save", root, "--metrics-jsonl", metrics, *extra]


def _hold_the_first_save_until_two_more_steps():
    """In the rank: the background writer of iteration 2 waits, before writing anything, until
    the training thread has finished iteration 4 (two more optimizer steps on the weights)."""
    finished_iteration_4 = threading.Event()
    steps = []
    train_step = Trainer.train_step

    def counted(self, data_iterator):
        result = train_step(self, data_iterator)
        steps.append(1)
        if len(steps) == 4:
            finished_iteration_4.set()
        return result

    def hold(phase, path):
        if phase == "staging_prepared" and "iter_0000002" in path:
            assert finished_iteration_4.wait(60), "the training thread did not get to iteration 4"

    Trainer.train_step = counted
    set_phase_hook(hold)


def test_an_async_checkpoint_is_bit_identical_to_a_synchronous_one(tmp_path, capfd):
    sync_root, async_root = str(tmp_path / "sync"), str(tmp_path / "async")
    assert train(_flags(sync_root, tmp_path / "sync.jsonl"), 1, tmp_path) == [0]
    capfd.readouterr()
    flags = _flags(async_root, tmp_path / "async.jsonl", "--async-save")
    assert train(flags, 1, tmp_path, on_rank=_hold_the_first_save_until_two_more_steps) == [0]
    out, err = capfd.readouterr()
    assert (
        f"saved checkpoint {iteration_dir(async_root, 2)} (iteration 2, in the background; complete at "
        "iteration 4)" in out
    ), err
    assert losses_by_iteration(tmp_path / "async.jsonl") == losses_by_iteration(tmp_path / "sync.jsonl")
    for iteration in (2, 4, 6):
        assert_same_contents(
            everything_in(iteration_dir(async_root, iteration)), everything_in(iteration_dir(sync_root, iteration))
        )
    assert read_latest_iteration(async_root) == 6
    weights = "embedding.word_embeddings.weight"
    at_2, at_4 = (everything_in(iteration_dir(sync_root, i))["tensors"][weights] for i in (2, 4))
    assert not torch.equal(at_2, at_4)  # the steps taken while iteration 2 was being saved changed it


def _fail_the_background_write_of_iteration_4():
    def fail(phase, path):
        if phase == "shards_written" and "iter_0000004" in path:
            raise OSError(28, "No space left on device (simulated)")

    set_phase_hook(fail)


def test_a_failed_background_save_stops_training_with_one_error_and_keeps_the_last_checkpoint(tmp_path, capfd):
    root = str(tmp_path / "run")
    codes = train(
        _flags(root, tmp_path / "m.jsonl", "--async-save"),
        1,
        tmp_path,
        on_rank=_fail_the_background_write_of_iteration_4,
    )
    out, err = capfd.readouterr()
    assert codes == [1]
    assert (
        f"CheckpointIOError: the asynchronous save of iteration 4 into {root} failed: OSError: [Errno 28] No space "
        "left on device (simulated); the tracker still names the last complete checkpoint"
    ) in err
    assert read_latest_iteration(root) == 2
    verify_checkpoint(iteration_dir(root, 2), ("model_config.json",))
    assert f"saved checkpoint {iteration_dir(root, 4)}" not in out
    capfd.readouterr()
    flags = _flags(root, tmp_path / "resumed.jsonl", "--async-save", "--load", root)
    assert train(flags, 1, tmp_path) == [0]
    out, _ = capfd.readouterr()
    assert f"loaded checkpoint {iteration_dir(root, 2)}:" in out and read_latest_iteration(root) == 6
    verify_checkpoint(iteration_dir(root, 4), ("model_config.json",))
