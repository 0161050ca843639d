"""Batch-size schedules (--step-batch-size-schedule, --rampup-batch-size): parsing by hand; a
run whose batch grows from 4 to 8 equals a run of batch 4 resumed with batch 8 (the same
samples, the same optimizer state), also on two data-parallel ranks and from the ramp-up form;
the LR schedule advances by samples (in iterations of the final batch) as Megatron's does; the
log line shows each iteration's batch; bad schedules fail before any process group."""

import json

import pytest

from megatron.training.arguments import ArgumentError
from megatron.training.batch_schedule import BatchSchedule, BatchScheduleError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny


def test_thresholds_count_tokens_with_suffixes():
    schedule = BatchSchedule.parse("0:16 2.4B:320, 4.8K:624", seq_length=2048)
    assert schedule.steps == ((0, 16), (2, 624), (1171875, 320))  # sorted by threshold
    assert schedule.final == 320 and not schedule.is_constant
    assert [schedule.batch_size(n) for n in (0, 1, 2, 1171874, 1171875)] == [16, 16, 624, 624, 320]
    assert schedule.samples(3) == 16 + 624 + 624 and schedule.iterations(16 + 624 + 1) == 3


def test_rampup_grows_in_equal_steps():
    assert BatchSchedule.rampup(4, 4, 32, 16).steps == ((0, 4), (11, 8), (21, 12), (32, 16))
    assert BatchSchedule.rampup(8, 4, 100, 8).is_constant


@pytest.mark.parametrize(
    "text, message",
    [
        ("16:8", "the first entry must start at threshold 0"),
        ("0:8 32:16 32:4", "two entries start at the same sample"),
        ("0:8 x:16", "'X' is not a number"),
        ("0-8", "entry '0-8' is not THRESHOLD:BATCH_SIZE"),
        ("0:0", "batch sizes must be >= 1"),
    ],
)
def test_bad_schedules(text, message):
    with pytest.raises(BatchScheduleError, match=message):
        BatchSchedule.parse(text, seq_length=16)


RUN = [*CURVE_RUN, "--num-layers", "2", "--eval-iters", "0", "--log-interval", "1", "--lr-warmup-iters", "0"]
GROWING = ["--step-batch-size-schedule", "0:4 128:8"]  # 8 samples of 16 tokens at batch 4, then 8


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if json.loads(line)["type"] == "train"]


@pytest.fixture(scope="module")
def stitched(tmp_path_factory):
    """Batch 4 for two iterations, saved, resumed with batch 8 for two more (constant LR)."""
    tmp = tmp_path_factory.mktemp("stitched")
    save, flags = str(tmp / "ckpt"), RUN + ["--lr-decay-style", "constant"]
    run_distributed(train_tiny, 1, flags + ["--global-batch-size", "4", "--train-iters", "2", "--save", save], "gpt", 1)
    resumed = ["--global-batch-size", "8", "--train-iters", "4", "--load", save, "--override-opt-param-scheduler"]
    run_distributed(train_tiny, 1, flags + resumed, "gpt", 1, tmp / "b.jsonl")
    return tmp / "b.jsonl"


@pytest.mark.parametrize(
    "schedule, world_size",
    [(GROWING, 1), (GROWING, 2), (["--rampup-batch-size", "4", "4", "8", "--global-batch-size", "8"], 1)],
    ids=["step-schedule", "step-schedule-dp2", "rampup"],
)
def test_a_growing_batch_is_a_run_resumed_with_the_larger_batch(stitched, schedule, world_size, tmp_path):
    flags = RUN + ["--lr-decay-style", "constant", "--train-iters", "4"] + schedule
    run_distributed(train_tiny, world_size, flags, "gpt", world_size, tmp_path / "m.jsonl")
    records = _records(tmp_path / "m.jsonl")
    assert [r["consumed_samples"] for r in records] == [4, 8, 16, 24]
    resumed = _records(stitched)
    assert [r["lm loss"] for r in records[2:]] == pytest.approx([r["lm loss"] for r in resumed], rel=1e-5)


def test_the_lr_schedule_counts_samples_and_the_log_shows_each_batch(tmp_path, capfd):
    # linear decay over 4 iterations of the final batch (32 samples): 4 + 4 + 8 + 8 samples = 3 of them
    flags = RUN + ["--lr-decay-style", "linear", "--lr", "0.004", "--train-iters", "4"] + GROWING
    run_distributed(train_tiny, 1, flags, "gpt", 1, tmp_path / "m.jsonl")
    lrs = [r["lr"] for r in _records(tmp_path / "m.jsonl")]
    assert lrs == pytest.approx([0.004 * (1 - n / 4) for n in (0.5, 1.0, 2.0, 3.0)])
    out = capfd.readouterr().out
    assert "global batch size:     4 |" in out and "global batch size:     8 |" in out
    assert "> global batch schedule: 4 from sample 0, 8 from sample 8" in out


def test_train_samples_count_iterations_through_the_schedule():
    args = tiny_args(RUN + GROWING + ["--train-samples", "25"])
    assert (args.train_iters, args.global_batch_size) == (5, 8)  # 4 + 4 + 8 + 8 = 24 < 25 <= 32


@pytest.mark.parametrize(
    "flags, message",
    [
        (GROWING + ["--global-batch-size", "16"], r"--global-batch-size \(16\) must be the schedule's last batch"),
        (["--step-batch-size-schedule", "0:3 128:8"], r"the global batch size \(3\) must be a multiple of"),
        (GROWING + ["--rampup-batch-size", "4", "4", "8"], "are mutually exclusive"),
        (["--rampup-batch-size", "4", "3", "8", "--global-batch-size", "8"], "in whole increments"),
        (["--step-batch-size-schedule", "256:8"], "^--step-batch-size-schedule: the first entry must start"),
    ],
)
def test_bad_schedule_flags(flags, message):
    with pytest.raises(ArgumentError, match=message):
        tiny_args(RUN + ["--train-iters", "4"] + flags)


def test_a_schedule_split_into_several_arguments_reads_the_same():
    """A script's unquoted ``${ARGS[@]}`` splits "0:4 128:8" (Megatron's GPT-3 example does)."""
    split = tiny_args(RUN + ["--train-iters", "4", "--step-batch-size-schedule", "0:4", "128:8"])
    assert split.batch_schedule == tiny_args(RUN + ["--train-iters", "4"] + GROWING).batch_schedule
