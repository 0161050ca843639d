"""--decoupled-lr / --decoupled-min-lr through the real trainer: the embeddings and the output
layer (and only they) step at the decoupled schedule's rate, in Muon's AdamW member too; a
checkpoint resumes with the flags added or dropped; the flags are checked before any process
group."""

import pytest

from megatron.training.arguments import ArgumentError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import losses_by_iteration
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny

RUN = [
    *CURVE_RUN,
    "--num-layers",
    "2",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--untie-embeddings-and-output-weights",
]
DECOUPLED = ["--decoupled-lr", "0.01", "--decoupled-min-lr", "0.001"]


def _groups(flags):
    """After two steps: (parameter names, lr) of each param group, and the scheduler's LRs."""
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import Trainer

    args = tiny_args(RUN + ["--train-iters", "4"] + flags)
    trainer = Trainer(args, initialize_megatron(args))
    iterator = trainer.data_iterator(trainer.train_ds, 0)
    for _ in range(2):
        trainer.train_step(iterator)
    names = {id(p): name for name, p in trainer.model.module.named_parameters()}
    groups = []
    for group in trainer.optimizer.param_groups:
        members = (
            trainer.optimizer.chained_optimizers
            if hasattr(trainer.optimizer, "chained_optimizers")
            else [trainer.optimizer]
        )
        by_master = {id(e.master): names[id(e.model_param)] for m in members for e in m.master_params}
        groups.append((sorted(by_master[id(t)] for t in group["params"]), group["lr"], group["is_decoupled_lr"]))
    return groups, trainer.scheduler.get_lr(), trainer.scheduler.get_lr(decoupled=True)


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_embeddings_and_output_layer_step_at_the_decoupled_rate(optimizer):
    ((groups, lr, decoupled_lr),) = run_distributed(_groups, 1, DECOUPLED + ["--optimizer", optimizer])
    assert decoupled_lr != pytest.approx(lr)
    decoupled = sorted(name for names, _, flag in groups if flag for name in names)
    assert decoupled == ["embedding.word_embeddings.weight", "output_layer.weight"]
    for names, group_lr, flag in groups:
        assert group_lr == pytest.approx(decoupled_lr if flag else lr), names


def test_resume_adds_or_drops_the_decoupled_rate(tmp_path):
    save = str(tmp_path / "ckpt")
    first = ["--train-iters", "2", "--lr-decay-iters", "4", "--save", save, "--save-interval", "2"]
    run_distributed(train_tiny, 1, RUN + first, "gpt", 1, None)
    resumed = ["--train-iters", "3", "--load", save, *DECOUPLED]
    run_distributed(train_tiny, 1, RUN + resumed + ["--override-opt-param-scheduler"], "gpt", 1, tmp_path / "a.jsonl")
    assert sorted(losses_by_iteration(tmp_path / "a.jsonl")) == [3]
    with pytest.raises(Exception, match=r"--decoupled-lr 0.01 \(checkpoint: None\)"):
        run_distributed(train_tiny, 1, RUN + resumed, "gpt", 1, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decoupled-min-lr", "0.001"], "--decoupled-min-lr needs --decoupled-lr"),
        (["--decoupled-lr", "0.0001", "--min-lr", "0.001"], r"the decoupled minimum LR \(0.001\) must be in"),
    ],
)
def test_bad_decoupled_flags(flags, message):
    with pytest.raises(ArgumentError, match=message):
        tiny_args(RUN + ["--train-iters", "4"] + flags)
