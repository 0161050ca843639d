"""--num-distributed-optimizer-instances on four data-parallel ranks: two (or four) instances
train the single-process curve with its gradient and parameter norms, overlapped or not and
with experts; each rank of an instance holds its share of the optimizer state (twice a
one-instance rank's); a checkpoint saved under two instances resumes under one; bad values fail
before any process group."""

import json

import pytest

from megatron.training.arguments import ArgumentError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import losses_by_iteration
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny

RUN = [*CURVE_RUN, "--num-layers", "2", "--eval-iters", "0", "--log-interval", "1", "--lr-warmup-iters", "0"]
RUN += ["--log-params-norm"]
SHARDED = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.0"]


def _statistics(flags, world_size, path):
    """Per iteration: (loss, grad norm, params norm)."""
    run_distributed(train_tiny, world_size, RUN + flags, "gpt", world_size, path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["lm loss"], r["grad_norm"], r["params_norm"]) for r in records if r["type"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _statistics(["--train-iters", "4"], 1, tmp_path_factory.mktemp("single") / "m.jsonl")


@pytest.mark.parametrize(
    "extra",
    [["2"], ["2", "--overlap-grad-reduce", "--overlap-param-gather"], ["4"]],
    ids=["two", "two-overlapped", "four"],
)
def test_instances_train_the_single_process_curve_and_norms(reference, extra, tmp_path):
    got = _statistics(["--train-iters", "4"] + SHARDED + extra, 4, tmp_path / "m.jsonl")
    assert [value for record in got for value in record] == pytest.approx(
        [value for record in reference for value in record], rel=1e-5
    )


def test_experts_shard_within_their_instance_too(tmp_path):
    single = _statistics(["--train-iters", "3"] + MOE, 1, tmp_path / "single.jsonl")
    flags = ["--train-iters", "3", *MOE, "--expert-model-parallel-size", "2", *SHARDED, "2"]
    got = _statistics(flags, 4, tmp_path / "ep2.jsonl")
    assert [v for r in got for v in r] == pytest.approx([v for r in single for v in r], rel=1e-5)


def _state_share(flags):
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import Trainer

    args = tiny_args(RUN + ["--train-iters", "1"] + flags, world_size=4)
    trainer = Trainer(args, initialize_megatron(args))
    trainer.train_step(trainer.data_iterator(trainer.train_ds, 0))
    total = sum(p.numel() for p in trainer.model.module.parameters())
    return trainer.optimizer.state_numel()["exp_avg"], total


def test_each_rank_holds_its_instances_share_of_the_optimizer_state():
    one = run_distributed(_state_share, 4, ["--use-distributed-optimizer"])
    two = run_distributed(_state_share, 4, SHARDED + ["2"])
    total = one[0][1]
    assert sum(share for share, _ in one) == total  # four disjoint quarters
    assert sum(share for share, _ in two[:2]) == total == sum(share for share, _ in two[2:])  # two halves each
    assert [share for share, _ in two] == [2 * share for share, _ in one[:2]] * 2


def test_a_checkpoint_of_two_instances_resumes_under_one(reference, tmp_path):
    save = str(tmp_path / "ckpt")
    first = ["--train-iters", "2", "--lr-decay-iters", "4", "--save", save, "--save-interval", "2"]
    run_distributed(train_tiny, 4, RUN + first + SHARDED + ["2"], "gpt", 4, tmp_path / "a.jsonl")
    resumed = ["--train-iters", "4", "--load", save, "--use-distributed-optimizer"]
    run_distributed(train_tiny, 2, RUN + resumed, "gpt", 2, tmp_path / "b.jsonl")
    losses = losses_by_iteration(tmp_path / "b.jsonl")
    assert [losses[3], losses[4]] == pytest.approx([record[0] for record in reference[2:]], rel=1e-5)


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (["--num-distributed-optimizer-instances", "2"], 4, "needs --use-distributed-optimizer"),
        (SHARDED + ["3"], 4, r"\(3\) must divide the 4 data-parallel \(DP x CP\) replicas"),
        (SHARDED + ["2"] + MOE + ["--expert-model-parallel-size", "4"], 4, "must divide the 1 expert data-parallel"),
        (SHARDED + ["0"], 4, "must be >= 1, got 0"),
    ],
)
def test_bad_instance_counts_are_argument_errors(flags, world, message):
    with pytest.raises(ArgumentError, match=f"^--num-distributed-optimizer-instances.*{message}"):
        tiny_args(RUN + ["--train-iters", "1"] + flags, world_size=world)
