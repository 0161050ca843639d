"""--exit-interval, --exit-duration-in-mins and --exit-signal-handler save, then stop cleanly
(no end-of-run evaluation); --check-weight-hash-across-dp-replicas-interval passes on agreeing
replicas and stops every rank on a diverged one; --manual-gc turns automatic collection off for
the run only; --profile with --use-pytorch-profiler writes a trace of the chosen iterations."""

import gc
import os
import re
import signal

import pytest

from megatron.core.dist_checkpointing import read_latest_iteration
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain
from tests.unit_tests.dist_harness import DistributedTestFailure, run_distributed

FLAGS = [
    *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8"),
    *("--micro-batch-size", "2", "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--vocab-size", "32"),
    *("--distributed-backend", "gloo", "--eval-iters", "1", "--log-interval", "1"),
]


def _train(flags):
    seen = []
    state = pretrain(parse_args(FLAGS + flags, world_size=1))
    seen.append(gc.isenabled())
    return state.iteration, seen


def test_exit_interval_saves_then_stops(tmp_path, capfd):
    (result,) = run_distributed(_train, 1, ["--exit-interval", "2", "--save", str(tmp_path)])
    assert result[0] == 2 and read_latest_iteration(str(tmp_path)) == 2
    out = capfd.readouterr().out
    assert "saved checkpoint" in out and "exiting program at iteration 2 (--exit-interval 2)" in out
    assert "validation loss" not in out  # an early exit skips the end-of-run evaluation


def test_exit_duration_saves_then_stops_after_the_first_iteration_past_it(tmp_path, capfd):
    (result,) = run_distributed(_train, 1, ["--exit-duration-in-mins", "1e-9", "--save", str(tmp_path)])
    assert result[0] == 1 and read_latest_iteration(str(tmp_path)) == 1
    assert "(--exit-duration-in-mins 1e-09)" in capfd.readouterr().out


def _signalled_at(iteration, rank_signalled, flags):
    """Train on 2 ranks; rank ``rank_signalled`` gets SIGTERM during step ``iteration``."""
    import torch.distributed as dist

    from megatron.training import training

    original = training.Trainer.train_step
    steps = []

    def step(self, iterator):
        steps.append(None)
        if len(steps) == iteration and dist.get_rank() == rank_signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, iterator)

    training.Trainer.train_step = step  # this rank is a forked process: the patch dies with it
    state = pretrain(parse_args(FLAGS + ["--train-iters", "10", *flags], world_size=2))
    return state.iteration, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_exit_signal_on_one_rank_saves_and_stops_every_rank_at_that_iteration(tmp_path, capfd):
    flags = ["--exit-signal-handler", "--save", str(tmp_path)]
    results = run_distributed(_signalled_at, 2, 3, 1, flags)
    assert results == [(3, True), (3, True)]  # the handler is given back when the loop ends
    assert read_latest_iteration(str(tmp_path)) == 3
    out = capfd.readouterr().out
    assert "exiting program on SIGTERM (--exit-signal-handler)" in out and "validation loss" not in out


def _diverge_at(iteration, flags, name_part=""):
    """Train on 2 ranks; with ``iteration``, rank 1 nudges one weight after that step: the first
    whose name contains ``name_part``."""
    import torch
    import torch.distributed as dist

    from megatron.training import training

    original = training.Trainer.train_step
    steps = []

    def step(self, iterator):
        result = original(self, iterator)
        steps.append(None)
        if len(steps) == iteration and dist.get_rank() == 1:
            with torch.no_grad():
                named = self.model_chunks[0].module.named_parameters()
                next(p for name, p in named if name_part in name).view(-1)[0] += 1e-3
        return result

    training.Trainer.train_step = step  # this rank is a forked process: the patch dies with it
    return pretrain(parse_args(FLAGS + ["--train-iters", "4", *flags], world_size=2)).iteration


CHECK = ["--check-weight-hash-across-dp-replicas-interval", "1", "--eval-iters", "0"]


def test_weight_hash_check_passes_on_replicas_that_agree():
    assert run_distributed(_diverge_at, 2, None, CHECK) == [4, 4]
    overlapped = ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"]
    assert run_distributed(_diverge_at, 2, None, CHECK + overlapped) == [4, 4]


def test_weight_hash_check_stops_every_rank_on_a_diverged_replica():
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(_diverge_at, 2, 2, CHECK)
    for rank in (0, 1):  # every rank stopped with the same error
        assert re.search(f"rank {rank}: \\S*ReplicaDivergedError: iteration 2: the dense weights", str(failure.value))
    assert "ranks [1] disagree with rank 0 (--check-weight-hash-across-dp-replicas-interval)" in str(failure.value)


TEST_MODE = ["--test-mode", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--eval-iters", "0"]


def test_test_mode_passes_on_tensor_parallel_replicas_that_agree():
    # sequence parallelism all-reduces the norms' gradients over TP: their copies stay equal
    assert run_distributed(_diverge_at, 2, None, TEST_MODE) == [4, 4]
    # a weight TP shards differs between the ranks anyway: nudging it is no divergence
    assert run_distributed(_diverge_at, 2, 2, TEST_MODE, "linear_qkv.weight") == [4, 4]


def test_test_mode_stops_every_rank_on_a_diverged_tensor_parallel_copy():
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(_diverge_at, 2, 2, TEST_MODE, "layernorm.weight")
    message = str(failure.value)
    for rank in (0, 1):
        assert f"rank {rank}: " in message
    diverged = "iteration 2: the dense weights of tensor-parallel replicas differ: ranks [1] disagree with rank 0"
    assert f"{diverged} (--test-mode)" in message


def _gc_during_training(flags):
    from megatron.training import training

    states = []
    original = training.Trainer.train_step

    def spy(self, iterator):
        states.append(gc.isenabled())
        return original(self, iterator)

    training.Trainer.train_step = spy  # this rank is a forked process: the patch dies with it
    pretrain(parse_args(FLAGS + flags, world_size=1))
    return states, gc.isenabled()


def test_manual_gc_turns_automatic_collection_off_for_the_run_only():
    ((during, after),) = run_distributed(_gc_during_training, 1, ["--manual-gc", "--manual-gc-interval", "2"])
    assert during == [False] * 5 and after is True


def test_pytorch_profiler_traces_the_chosen_iterations(tmp_path):
    flags = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4"]
    run_distributed(_train, 1, flags + ["--tensorboard-dir", str(tmp_path)])
    traces = [p for p in tmp_path.iterdir() if p.name.endswith(".pt.trace.json")]
    assert len(traces) == 1 and traces[0].stat().st_size > 1000


def _evaluations_logged(flags):
    from megatron.training import training

    logged = []
    original = training.MetricsLogger.log_evaluation

    def spy(self, **kwargs):
        logged.append(kwargs["label"])
        return original(self, **kwargs)

    training.MetricsLogger.log_evaluation = spy  # this rank is a forked process: the patch dies with it
    state = pretrain(parse_args(FLAGS + flags, world_size=1))
    return state.iteration, logged


def test_an_eval_interval_with_no_eval_iters_evaluates_nothing():
    """Megatron accepts --eval-interval with --eval-iters 0 (its reruns tests do): no evaluation."""
    ((iteration, logged),) = run_distributed(_evaluations_logged, 1, ["--eval-interval", "1", "--eval-iters", "0"])
    assert (iteration, logged) == (5, [])
    ((_, evaluated),) = run_distributed(_evaluations_logged, 1, ["--eval-interval", "1", "--eval-iters", "1"])
    assert evaluated.count("validation") == 5 + 1  # every iteration, and after training
