"""A save killed (SIGKILL, real processes) at every phase, then the job resumed with the same
--load/--save directory: it resumes from the last complete checkpoint, reproduces the straight
run exactly and its later saves succeed. Iterations newer than the tracker are verified before
they are adopted; incomplete or damaged ones are replaced, never loaded."""

import json
import os
import shutil
import signal

import pytest

from megatron.core.dist_checkpointing import (
    SAVE_PHASES,
    TRACKER_FILENAME,
    iteration_dir,
    read_latest_iteration,
    verify_checkpoint,
)
from tests.unit_tests.training.forked_training import Kill, train
from tests.unit_tests.training.loss_curve import losses_by_iteration

FORMAT_1 = os.path.join(os.path.dirname(__file__), "..", "dist_checkpointing", "data", "format_v1_training")
KILLED = -signal.SIGKILL


def _flags(root, iters, *extra):
    return ["--train-iters", iters, "--save-interval", "2", "--save", root, *extra]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: 10 iterations straight, saving every 2; its losses by iteration."""
    tmp = tmp_path_factory.mktemp("straight")
    assert train(_flags(tmp / "run", 10, "--metrics-jsonl", tmp / "m.jsonl"), 1, tmp) == [0]
    return losses_by_iteration(tmp / "m.jsonl")


def _resume(root, tmp_path, iters=10, world_size=1, kill=None, extra=()):
    """Run ``--load root --save root`` to ``iters``; (exit codes, losses by iteration, stdout, stderr)."""
    metrics = tmp_path / f"resumed-{len(os.listdir(tmp_path))}.jsonl"
    flags = _flags(root, iters, "--load", root, "--metrics-jsonl", metrics, *extra)
    codes = train(flags, world_size, tmp_path, kill=kill)
    return codes, losses_by_iteration(metrics) if metrics.exists() else {}


def _assert_complete(root, iterations):
    assert sorted(os.listdir(root)) == sorted([TRACKER_FILENAME, *(f"iter_{i:07d}" for i in iterations)])
    for iteration in iterations:
        verify_checkpoint(iteration_dir(root, iteration), ("model_config.json",))


def _flip_a_weight_byte(checkpoint: str) -> str:
    chunk = json.load(open(os.path.join(checkpoint, "metadata.json")))["tensors"]["embedding.word_embeddings.weight"]
    chunk = chunk["chunks"][0]
    shard = os.path.join(checkpoint, chunk["file"])
    blob = bytearray(open(shard, "rb").read())
    blob[chunk["offset"] + chunk["length"] // 2] ^= 0x40  # inside the item: any byte is checksummed
    open(shard, "wb").write(bytes(blob))
    return shard


# Each run is killed at the next phase of a save (alternately in --async-save's background
# writer) and the next run resumes the same directory. Until a directory is published the last
# complete checkpoint is the one before; once published it is that one, adopted by the next
# run when the tracker had not moved yet.
CHAIN = [
    # (kill phase, while saving iteration, async, the last complete checkpoint afterwards)
    ("staging_prepared", 4, False, 2),
    ("item_written", 4, True, 2),
    ("shards_written", 4, False, 2),
    ("metadata_written", 4, True, 2),
    ("published", 4, False, 4),
    ("published", 6, True, 6),
    ("tracker_written", 8, False, 8),
]


def test_a_save_killed_at_every_phase_in_turn_always_resumes_from_the_last_complete_checkpoint(
    straight, tmp_path, capfd
):
    root = str(tmp_path / "run")
    assert set(SAVE_PHASES) == {phase for phase, *_ in CHAIN}
    resumes_from = None
    for phase, iteration, async_save, complete in CHAIN:
        extra = ["--async-save"] if async_save else []
        kill = Kill(phase, iteration)
        if resumes_from is None:
            codes, losses = train(_flags(root, 10, *extra), 1, tmp_path, kill=kill), {}
        else:
            codes, losses = _resume(root, tmp_path, kill=kill, extra=extra)
        out, err = capfd.readouterr()
        assert codes == [KILLED], err
        if resumes_from is not None:
            assert f"loaded checkpoint {iteration_dir(root, resumes_from)}:" in out
            assert (f"adopted {iteration_dir(root, resumes_from)}" in err) == (resumes_from in (4, 6))
        assert all(losses[i] == straight[i] for i in losses)  # bit-identical to the straight run
        assert read_latest_iteration(root) == (complete if phase == "tracker_written" else min(complete, iteration - 2))
        resumes_from = complete
    codes, losses = _resume(root, tmp_path)  # later saves succeed
    out, err = capfd.readouterr()
    assert codes == [0], err
    assert f"loaded checkpoint {iteration_dir(root, 8)}:" in out and sorted(losses) == [9, 10]
    assert all(losses[i] == straight[i] for i in losses)
    _assert_complete(root, (2, 4, 6, 8, 10))


def test_two_ranks_with_the_coordinator_killed_between_publish_and_tracker(tmp_path, capfd):
    root = str(tmp_path / "run")
    codes = train(_flags(root, 6), 2, tmp_path, kill=Kill("published", 4, rank=0))
    assert codes[0] == KILLED and codes[1] != 0  # its peer fails instead of hanging
    assert read_latest_iteration(root) == 2 and os.path.isdir(iteration_dir(root, 4))
    capfd.readouterr()
    codes, losses = _resume(root, tmp_path, iters=6, world_size=2)
    out, err = capfd.readouterr()
    assert codes == [0, 0], err
    assert f"loaded checkpoint {iteration_dir(root, 4)}:" in out and sorted(losses) == [5, 6]
    _assert_complete(root, (2, 4, 6))


def test_untracked_iterations_that_are_incomplete_or_damaged_are_replaced_never_loaded(tmp_path, capfd):
    """One as an older version left it when killed after publishing but before it wrote
    model_config.json (this checkpoint is in the previous on-disk format, which also resumes),
    one with a flipped byte. The reference: the same checkpoint resumed without them."""
    clean = str(tmp_path / "clean")
    shutil.copytree(FORMAT_1, clean)
    codes, reference = _resume(clean, tmp_path, iters=6)
    assert codes == [0] and sorted(reference) == [3, 4, 5, 6]
    capfd.readouterr()
    root = str(tmp_path / "run")
    shutil.copytree(FORMAT_1, root)
    shutil.copytree(iteration_dir(root, 2), iteration_dir(root, 4))
    os.remove(os.path.join(iteration_dir(root, 4), "model_config.json"))
    shutil.copytree(iteration_dir(root, 2), iteration_dir(root, 6))
    shard = _flip_a_weight_byte(iteration_dir(root, 6))
    codes, losses = _resume(root, tmp_path, iters=6)
    out, err = capfd.readouterr()
    assert codes == [0], err
    for iteration, problem in (
        (4, "model_config.json is missing"),
        (6, f"CorruptCheckpointError: {shard} is corrupted"),
    ):
        assert f"{iteration_dir(root, iteration)} is newer than the tracker but incomplete" in err and problem in err
        assert f"replacing {iteration_dir(root, iteration)}" in err
    assert f"loaded checkpoint {iteration_dir(root, 2)}:" in out
    assert losses == reference  # bit-identical: nothing of the damaged iterations was loaded
    _assert_complete(root, (2, 4, 6))
