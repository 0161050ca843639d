"""--rerun-mode through the real training loop on two data-parallel ranks: a fault seen only by
the first run of a step is transient (exit code 17); a reproducible one saves a checkpoint and
exits with 16, and the resumed job re-runs the step on another device to call it persistent or
correct (17), or exits with 16 again on the same device; faults are injected by Megatron's
--error-injection-* flags and by real NaNs in the loss and in the weights. report_stats runs
each step twice without changing the curve; disabled stops on a NaN loss unless the check is
off; the spiky-loss check by hand."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.dist_checkpointing import read_latest_iteration
from megatron.training.result_validation import RERUN_STATE_FILENAME, ResultValidationExit, ResultValidator
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args

RUN = [*CURVE_RUN, "--num-layers", "2", "--train-iters", "4", "--eval-iters", "0", "--log-interval", "1"]


def _train(flags, world_size=2, nan_loss_on_runs=(), nan_weights_after_step=None, device=None):
    """Train on this rank; returns ("done", iteration) or ("exit", code, message). The loss of the
    forward-backward runs numbered in ``nan_loss_on_runs`` (1-based, counting re-runs) reads NaN;
    after step ``nan_weights_after_step`` a weight turns NaN; ``device`` stands for another
    node's device identity (a rescheduled job)."""
    from megatron.training import result_validation, training

    run_schedule, train_step, runs, steps = training.Trainer._run_schedule, training.Trainer.train_step, [], []

    def counted_schedule(self, iterator, forward_only, *rest):
        loss, tokens = run_schedule(self, iterator, forward_only, *rest)
        if not forward_only:
            runs.append(None)
            if len(runs) in nan_loss_on_runs:
                loss = loss * math.nan
        return loss, tokens

    def poisoning_step(self, iterator):
        result = train_step(self, iterator)
        steps.append(None)
        if len(steps) == nan_weights_after_step:
            with torch.no_grad():
                next(self.model_chunks[0].module.parameters()).fill_(math.nan)
        return result

    # this rank is a forked process: the patches die with it
    training.Trainer._run_schedule, training.Trainer.train_step = counted_schedule, poisoning_step
    if device is not None:
        result_validation.device_identity = lambda: device
    try:
        return ("done", training.pretrain(tiny_args(RUN + flags, world_size=world_size)).iteration)
    except ResultValidationExit as stop:
        return ("exit", stop.exit_code, str(stop))


def _events(path) -> list[str]:
    return [json.loads(line)["status"] for line in path.read_text().splitlines()]


def test_a_fault_the_rerun_does_not_reproduce_is_transient(tmp_path, capfd):
    tracker = tmp_path / "rejected.jsonl"
    flags = ["--result-rejected-tracker-filename", str(tracker)]
    # run 2 is iteration 2's first run (iteration 1 is never checked): its loss reads NaN once
    results = run_distributed(_train, 2, flags, 2, (2,))
    assert [r[:2] for r in results] == [("exit", 17)] * 2
    assert "iteration 2: found NaN or Inf in the loss, not reproducible: possible transient error" in results[0][2]
    out = capfd.readouterr().out
    assert "First rerun: unexpected result is not reproducible within the tolerance (" in out
    assert "Possible transient error!" in out
    assert sorted(_events(tracker)) == sorted(["initial_run", "first_rerun_not_reproducible"] * 2)  # both ranks


def test_nan_weights_reproduce_everywhere_and_are_called_a_correct_result(tmp_path, capfd):
    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-interval", "10"]
    results = run_distributed(_train, 2, flags, 2, (), 2)  # NaN weights after step 2: step 3's loss is NaN
    assert [r[:2] for r in results] == [("exit", 16)] * 2
    assert "iteration 3: found NaN or Inf in the loss, reproducible on this device" in results[0][2]
    assert read_latest_iteration(save) == 2  # the state before the failed step
    record = json.loads((tmp_path / "ckpt" / RERUN_STATE_FILENAME).read_text())
    assert (record["iteration"], record["fatal"], len(record["devices"])) == (3, True, 2)
    out = capfd.readouterr().out
    assert "First rerun: unexpected result is reproducible within the tolerance (nan = nan)" in out
    assert "Saving a checkpoint and exiting now. Please resume the job from the checkpoint" in out

    resume = ["--load", save, "--save", save]
    same = run_distributed(_train, 2, resume, 2)
    assert [r[:2] for r in same] == [("exit", 16)] * 2  # the same device: resume again, elsewhere
    assert "Got rescheduled on the same GPU" in capfd.readouterr().out
    assert (tmp_path / "ckpt" / RERUN_STATE_FILENAME).exists()

    elsewhere = run_distributed(_train, 2, resume, 2, (), None, "another-node:cuda:0")
    assert [r[:2] for r in elsewhere] == [("exit", 17)] * 2
    assert "Correct result (but possible Application error) (found NaN or Inf in the loss)" in elsewhere[0][2]
    assert "Second rerun: unexpected result is reproducible on a different GPU" in capfd.readouterr().out
    assert not (tmp_path / "ckpt" / RERUN_STATE_FILENAME).exists()


@pytest.mark.parametrize(
    "kind, verdict",
    [("persistent_error", "Possible persistent error!"), ("correct_result", "Correct result (but possible")],
)
def test_injected_errors_follow_their_diagnosis(kind, verdict, tmp_path):
    save = str(tmp_path / "ckpt")
    inject = ["--error-injection-rate", "1", "--error-injection-type", kind, "--save", save]
    assert [r[:2] for r in run_distributed(_train, 2, inject, 2)] == [("exit", 16)] * 2
    assert read_latest_iteration(save) == 1
    resumed = run_distributed(_train, 2, ["--load", save, "--save", save], 2, (), None, "another-node:cuda:1")
    assert [r[:2] for r in resumed] == [("exit", 17)] * 2
    assert verdict in resumed[0][2]


def test_transient_injection_exits_after_the_first_rerun():
    inject = ["--error-injection-rate", "1", "--error-injection-type", "transient_error"]
    assert [r[:2] for r in run_distributed(_train, 2, inject, 2)] == [("exit", 17)] * 2


def test_without_save_a_reproducible_fault_ends_the_job(tmp_path):
    results = run_distributed(_train, 2, [], 2, (), 1)
    assert [r[:2] for r in results] == [("exit", 17)] * 2
    assert "without --save there is no checkpoint to re-run it elsewhere" in results[0][2]


def test_report_stats_runs_each_step_twice_and_keeps_the_curve(tmp_path, capfd):
    reference = tmp_path / "validate.jsonl"
    run_distributed(_train, 2, ["--metrics-jsonl", str(reference)], 2)
    stats = tmp_path / "stats.jsonl"
    assert (
        run_distributed(_train, 2, ["--rerun-mode", "report_stats", "--metrics-jsonl", str(stats)], 2)
        == [("done", 4)] * 2
    )
    assert loss_curve(stats) == loss_curve(reference)
    out = capfd.readouterr().out
    assert out.count("loss rerun relative difference: max 0.000E+00 (--rerun-mode report_stats)") == 4


def test_disabled_mode_stops_on_a_nan_loss_unless_the_check_is_off(tmp_path):
    disabled = ["--rerun-mode", "disabled"]
    results = run_distributed(_train, 2, disabled, 2, (1,))
    assert [r[:2] for r in results] == [("exit", 1)] * 2
    assert "iteration 1: found NaN or Inf in the loss (--rerun-mode disabled" in results[0][2]
    metrics = tmp_path / "m.jsonl"
    unchecked = disabled + ["--no-check-for-nan-in-loss-and-grad", "--metrics-jsonl", str(metrics)]
    assert run_distributed(_train, 2, unchecked, 2, (1,)) == [("done", 4)] * 2
    assert math.isnan(loss_curve(metrics)[0])


def _spiky(losses):
    import torch.distributed as dist

    args = SimpleNamespace(
        rerun_mode="validate_results",
        check_for_nan_in_loss_and_grad=True,
        check_for_spiky_loss=True,
        error_injection_rate=0,
        error_injection_type="transient_error",
        seed=1,
        result_rejected_tracker_filename=None,
        save=None,
    )
    validator = ResultValidator(args, True, torch.device("cpu"))
    assert dist.get_world_size() == 1
    return [validator._check(loss) for loss in losses]


def test_a_loss_ten_times_the_largest_of_the_first_hundred_is_spiky_and_not_fatal():
    ((*first, below, spike, nan),) = run_distributed(_spiky, 1, [2.0] * 99 + [3.0, 29.9, 30.0, math.nan])
    assert first == [None] * 100 and below is None
    assert (spike.message, spike.fatal, spike.result) == ("spiky loss", False, 30.0)
    assert (nan.message, nan.fatal) == ("found NaN or Inf in the loss", True)
