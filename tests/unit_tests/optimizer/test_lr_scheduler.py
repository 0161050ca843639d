"""LR schedule values at hand-computed iterations, param-group updates, resume, and flag errors."""

import json
import math

import pytest
import torch

from megatron.core.optimizer.lr_scheduler import LRSchedulerConfigError, OptimizerParamScheduler


def make_optimizer():
    """Two groups: the second, like biases and norms, gets half the LR and no weight decay."""
    weights, biases = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    return torch.optim.SGD([{"params": [weights]}, {"params": [biases], "lr_mult": 0.5, "wd_mult": 0.0}], lr=123.0)


def make_scheduler(style, optimizer=None, **overrides):
    settings = dict(max_lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_iters=110, lr_decay_style=style)
    settings.update(overrides)
    return OptimizerParamScheduler(optimizer or make_optimizer(), **settings)


# Iteration -> LR with max 1.0, min 0.1, 10 warm-up iterations from 0, decay ends at 110.
COS_QUARTER = 0.1 + 0.45 * (1 + math.cos(math.pi / 4))
COS_THREE_QUARTERS = 0.1 + 0.45 * (1 - math.cos(math.pi / 4))
EXPECTED = {
    "linear": {35: 0.775, 60: 0.55, 85: 0.325, 110: 0.1, 111: 0.1, 1000: 0.1},
    "cosine": {35: COS_QUARTER, 60: 0.55, 85: COS_THREE_QUARTERS, 110: 0.1, 500: 0.1},
    "constant": {11: 1.0, 60: 1.0, 110: 1.0, 1000: 1.0},
    # max * sqrt(warmup / n), floored at min, then min after the decay iterations.
    "inverse-square-root": {40: 0.5, 90: 1 / 3, 110: math.sqrt(10 / 110), 111: 0.1},
}


@pytest.mark.parametrize("style", sorted(EXPECTED))
def test_lr_at_hand_computed_iterations(style):
    scheduler = make_scheduler(style)
    for n, lr in {0: 0.0, 5: 0.5, 10: 1.0, **EXPECTED[style]}.items():
        assert scheduler.get_lr(n) == pytest.approx(lr, abs=1e-12), (style, n)


def test_warmup_starts_from_init_lr():
    scheduler = make_scheduler("linear", init_lr=0.2)
    assert [scheduler.get_lr(n) for n in (0, 5, 10)] == pytest.approx([0.2, 0.6, 1.0])


def test_no_warmup_starts_at_max_lr():
    scheduler = make_scheduler("cosine", lr_warmup_iters=0, lr_decay_iters=100)
    assert scheduler.get_lr(0) == 1.0
    assert scheduler.get_lr(50) == pytest.approx(0.55)


def test_inverse_square_root_is_floored_at_min_lr():
    scheduler = make_scheduler("inverse-square-root", min_lr=0.4)
    assert scheduler.get_lr(90) == pytest.approx(0.4)


def test_step_writes_lr_and_weight_decay_into_param_groups_with_multipliers():
    optimizer = make_optimizer()
    scheduler = make_scheduler("linear", optimizer, weight_decay=0.01)
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # construction applies iteration 0
    for _ in range(5):
        scheduler.step()
    assert scheduler.num_iters == 5
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 0.25])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    scheduler.step(55)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.55, 0.275])


def test_state_dict_round_trips_through_json_and_resumes_the_schedule():
    original = make_scheduler("cosine", weight_decay=0.1)
    original.step(37)
    state = json.loads(json.dumps(original.state_dict()))
    assert state["num_iters"] == 37
    optimizer = make_optimizer()
    resumed = make_scheduler("cosine", optimizer, weight_decay=0.1)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == original.state_dict()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(original.get_lr())
    for _ in range(20):
        original.step()
        resumed.step()
        assert resumed.get_lr() == original.get_lr()


def test_load_with_a_different_schedule_names_the_flags():
    state = make_scheduler("cosine").state_dict()
    other = make_scheduler("linear", max_lr=2.0)
    with pytest.raises(
        LRSchedulerConfigError,
        match=r"differs from the arguments: --lr 2.0 \(checkpoint: 1.0\), --lr-decay-style linear "
        r"\(checkpoint: cosine\); pass --override-opt-param-scheduler .* --use-checkpoint-opt-param-scheduler",
    ):
        other.load_state_dict(state)


def test_load_mismatch_policies():
    state = {**make_scheduler("cosine").state_dict(), "num_iters": 60}
    kept = make_scheduler("linear", max_lr=2.0)
    kept.load_state_dict(state, on_mismatch="use_current")
    assert (kept.lr_decay_style, kept.max_lr, kept.num_iters) == ("linear", 2.0, 60)
    adopted = make_scheduler("linear", max_lr=2.0)
    adopted.load_state_dict(state, on_mismatch="use_checkpoint")
    assert (adopted.lr_decay_style, adopted.max_lr) == ("cosine", 1.0)
    assert adopted.get_lr() == pytest.approx(0.55)


def test_load_rejects_incomplete_or_invalid_state():
    scheduler = make_scheduler("linear")
    with pytest.raises(LRSchedulerConfigError, match=r"state is missing lr_decay_iters, num_iters"):
        incomplete = {k: v for k, v in scheduler.state_dict().items() if k not in ("num_iters", "lr_decay_iters")}
        scheduler.load_state_dict(incomplete)
    bad = {**scheduler.state_dict(), "min_lr": 5.0}
    with pytest.raises(LRSchedulerConfigError, match=r"--min-lr \(5.0\) must be <= --lr \(1.0\)"):
        scheduler.load_state_dict(bad, on_mismatch="use_checkpoint")
    assert scheduler.min_lr == 0.1  # nothing half-applied
    with pytest.raises(LRSchedulerConfigError, match=r"on_mismatch 'ignore' is unknown; accepted: error, use_current"):
        scheduler.load_state_dict(scheduler.state_dict(), on_mismatch="ignore")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"min_lr": 2.0}, r"--min-lr \(2.0\) must be <= --lr \(1.0\)"),
        ({"lr_warmup_iters": 200}, r"--lr-warmup-iters \(200\) must be <= --lr-decay-iters \(110\)"),
        ({"lr_decay_iters": 0, "lr_warmup_iters": 0}, r"--lr-decay-iters \(0\) must be >= 1"),
        ({"lr_warmup_iters": -1}, r"--lr-warmup-iters \(-1\) must be >= 0"),
        ({"max_lr": -1.0}, r"--lr \(-1.0\) must be a finite number >= 0"),
        ({"weight_decay": float("nan")}, r"--weight-decay \(nan\) must be a finite number >= 0"),
        (
            {"lr_decay_style": "wsd"},
            r"--lr-decay-style 'wsd' is unknown; accepted: constant, linear, cosine, inverse-square-root",
        ),
    ],
)
def test_bad_settings_fail_naming_the_flags(overrides, message):
    with pytest.raises(LRSchedulerConfigError, match=message):
        make_scheduler(overrides.pop("lr_decay_style", "linear"), **overrides)


def test_decoupled_groups_follow_the_schedule_between_their_own_bounds():
    """Megatron's --decoupled-lr / --decoupled-min-lr: the same warm-up and cosine decay, from
    init_lr up to 3.0 and down to 0.3, for the groups marked ``is_decoupled_lr`` only."""
    weights, embedding = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([{"params": [weights]}, {"params": [embedding], "is_decoupled_lr": True}], lr=1.0)
    scheduler = make_scheduler("cosine", optimizer, decoupled_lr=3.0, decoupled_min_lr=0.3)
    for n, (lr, decoupled) in {5: (0.5, 1.5), 10: (1.0, 3.0), 60: (0.55, 1.65), 110: (0.1, 0.3)}.items():
        scheduler.num_iters = n
        scheduler.step(0)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr, decoupled]), n
    only_max = make_scheduler("linear", make_optimizer(), decoupled_lr=2.0)
    assert only_max.get_lr(110, decoupled=True) == pytest.approx(0.1)  # --min-lr when no decoupled minimum
    assert only_max.get_lr(60, decoupled=True) == pytest.approx(0.1 + 0.5 * 1.9)


def test_schedules_saved_before_decoupled_settings_existed_resume():
    state = make_scheduler("linear").state_dict()
    for name in ("decoupled_lr", "decoupled_min_lr"):
        del state[name]
    resumed = make_scheduler("linear")
    resumed.load_state_dict({**state, "num_iters": 60})
    assert resumed.get_lr() == pytest.approx(0.55)
    with pytest.raises(LRSchedulerConfigError, match=r"--decoupled-lr 2.0 \(checkpoint: None\)"):
        make_scheduler("linear", decoupled_lr=2.0).load_state_dict(state)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"decoupled_min_lr": 0.1}, r"--decoupled-min-lr \(0.1\) needs --decoupled-lr"),
        ({"decoupled_lr": 0.05}, r"the decoupled minimum LR \(0.1\) must be <= --decoupled-lr \(0.05\)"),
        ({"decoupled_lr": -1.0}, r"--decoupled-lr \(-1.0\) must be a finite number >= 0"),
    ],
)
def test_bad_decoupled_settings(overrides, message):
    with pytest.raises(LRSchedulerConfigError, match=message):
        make_scheduler("linear", **overrides)
