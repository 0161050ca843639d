"""Megatron's ``--rerun-mode``: re-run a training step whose result fails a check, to tell a
transient fault, a persistent (device) fault and a correct but unexpected result apart.

Checks (on the loss of the step, where the last pipeline stage holds it): a non-finite loss
(``--check-for-nan-in-loss-and-grad``, on by default; fatal) and, with
``--check-for-spiky-loss``, a loss at least 10x the largest of the first 100 (not fatal).
``--error-injection-rate N`` makes a check fail at random once in N steps per rank, as
``--error-injection-type`` describes (for testing the machinery). The first step of a job is
not checked (a checkpoint may not hold an optimizer step yet).

``validate_results`` (Megatron's default): when a check fails on any rank, every rank re-runs
the step from the same RNG states and samples (nothing was stepped yet):

- a different result: "Possible transient error!"; fatal checks end the job (exit code 17, resume
  from the last checkpoint), others continue with the re-run;
- the same result: fatal checks save a checkpoint of the state before the step, record the
  failure in ``<save>/rerun_state.json`` and end the job with exit code 16: resumed on another
  device, the first step is re-run there. The same result again means the computation was right
  ("Correct result (but possible Application error)"), a different one points at the first
  device ("Possible persistent error!"); both end the job with exit code 17. Resumed on the same
  device, the job ends with code 16 again. Non-fatal checks continue after the first re-run.

``report_stats``: every step runs twice; the largest relative difference of the loss between the
two runs is reported with each log line (non-deterministic kernels show there).
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.dist_utils import all_gather_object
from megatron.core.errors import MegatronRuntimeError

EXIT_RESUME_TO_DISAMBIGUATE = 16
EXIT_FAILED_ON_RESULT_VALIDATION = 17
RERUN_STATE_FILENAME = "rerun_state.json"
ERROR_TYPES = ("correct_result", "transient_error", "persistent_error")
SPIKY_THRESHOLD, SPIKY_SAMPLES = 10.0, 100
NAN_MESSAGE = "found NaN or Inf in the loss"
SPIKY_MESSAGE = "spiky loss"


class ResultValidationExit(MegatronRuntimeError):
    """The job ends because of a failed result check; ``exit_code`` is Megatron's (16: resume
    from the checkpoint on another device to finish the diagnosis, 17: diagnosis complete)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def device_identity() -> str:
    """The node and device this rank computes on (a re-run must happen elsewhere)."""
    node = socket.gethostname()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        return f"{node}:cuda:{index}:{torch.cuda.get_device_properties(index).uuid}"
    return f"{node}:cpu"


def relative_difference(first: float, second: float) -> float:
    """0 for equal results (NaNs equal each other), else ``|a - b| / max(|a|, |b|)`` (inf when
    only one is finite)."""
    if first == second or (math.isnan(first) and math.isnan(second)):
        return 0.0
    if not (math.isfinite(first) and math.isfinite(second)):
        return math.inf
    return abs(first - second) / max(abs(first), abs(second))


@dataclass
class Failure:
    """A failed check: which, whether fatal, the result it saw, and (error injection) the kind
    of fault simulated."""

    message: str
    fatal: bool
    result: float
    injected: str | None = None


class ResultValidator:
    """Checks each step's loss and drives the re-runs (see the module docstring). Every method
    that decides is collective over the world: all ranks re-run, save and exit together."""

    def __init__(self, args, holds_loss: bool, device: torch.device):
        self.mode = args.rerun_mode
        self.check_nan = args.check_for_nan_in_loss_and_grad
        self.check_spiky = args.check_for_spiky_loss
        self.injection_rate, self.injection_type = args.error_injection_rate, args.error_injection_type
        self.injector = random.Random(args.seed * 7919 + dist.get_rank())  # the training RNGs stay untouched
        self.tracker = args.result_rejected_tracker_filename
        self.save_root = args.save
        self.holds_loss = holds_loss
        self.stats_device = device
        self.first_step_done = False
        self.largest: float = 0.0
        self.samples = 0
        self.pending: dict | None = None  # a failure to re-run on another device (from --load)
        self.differences: list[float] = []  # report_stats: since the last report

    def run_step(
        self,
        iteration: int,
        forward_backward: Callable[[bool], tuple],
        save_before_step: Callable[[], None],
    ) -> tuple:
        """Run ``forward_backward(again)`` (``again``: from the step's start once more) as often
        as the mode needs; returns the result of the run whose gradients the step keeps."""
        result = forward_backward(False)
        loss = float(result[0]) if self.holds_loss else None
        if self.mode == "disabled":  # Megatron's backward-compatible check: a non-finite loss stops the job
            bad = self.check_nan and loss is not None and not math.isfinite(loss)
            if self._any(bad):
                raise ResultValidationExit(
                    f"iteration {iteration}: {NAN_MESSAGE} (--rerun-mode disabled; --no-check-for-nan-in-loss-and-grad "
                    "skips such steps instead)",
                    1,
                )
            return result
        if self.mode == "report_stats":
            again = forward_backward(True)
            if self.holds_loss:
                self.differences.append(relative_difference(loss, float(again[0])))
            return again
        if self.pending is not None:
            return self._second_rerun(iteration, result, loss)
        seen = self._check(loss) if self.first_step_done else None
        self.first_step_done = True
        if not self._any(seen is not None):
            return result
        if seen is not None:
            self._record(iteration, "initial_run", seen.result, seen.message)
            self._log(f"Unexpected result {seen.result} at iteration {iteration} ({seen.message})", everywhere=True)
        failure = next(f for f in all_gather_object(seen, None) if f is not None)  # the lowest rank's
        self._log("Need to rerun step to check reproducibility of initial result")
        again = forward_backward(True)
        rerun_loss = float(again[0]) if self.holds_loss else None
        reproduced = self._reproduced(failure, rerun_loss, first_rerun=True)
        if not reproduced:
            self._record(iteration, "first_rerun_not_reproducible", rerun_loss, failure.message)
            self._log(
                f"First rerun: unexpected result is not reproducible within the tolerance ({rerun_loss} != "
                f"{failure.result})"
            )
            self._log("Possible transient error!")
            if failure.fatal:
                raise ResultValidationExit(
                    f"iteration {iteration}: {failure.message}, not reproducible: possible transient error; the job "
                    "can be resumed from a previous checkpoint",
                    EXIT_FAILED_ON_RESULT_VALIDATION,
                )
            return again
        self._record(iteration, "first_rerun_reproducible", rerun_loss, failure.message)
        self._log(
            f"First rerun: unexpected result is reproducible within the tolerance ({rerun_loss} = {failure.result}). "
            "Need to rerun on a different GPU to verify correctness."
        )
        if not failure.fatal:
            self._log("Continuing normal execution because failed validation was not fatal")
            return again
        if self.save_root is None:
            raise ResultValidationExit(
                f"iteration {iteration}: {failure.message}, reproducible on this device; without --save there is "
                "no checkpoint to re-run it elsewhere",
                EXIT_FAILED_ON_RESULT_VALIDATION,
            )
        save_before_step()
        self._write_pending(iteration, failure)
        self._log(
            "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic"
        )
        raise ResultValidationExit(
            f"iteration {iteration}: {failure.message}, reproducible on this device; resume from the checkpoint on "
            "another device to finish the diagnosis",
            EXIT_RESUME_TO_DISAMBIGUATE,
        )

    def _second_rerun(self, iteration: int, result: tuple, loss: float | None) -> tuple:
        """The step that failed before, re-run after a resume: on the same device the job ends
        to be rescheduled; elsewhere the result decides between a persistent fault and a correct
        result."""
        pending, self.pending = self.pending, None
        self.first_step_done = True
        failure = Failure(pending["message"], pending["fatal"], pending["result"], pending["injected"])
        same_device = pending["devices"][dist.get_rank()] == device_identity()
        if self._any(same_device):
            self.pending = pending
            self._log("Got rescheduled on the same GPU. Need to resume again from the same checkpoint")
            raise ResultValidationExit(
                f"iteration {iteration}: the re-run of the failed step landed on the device that failed it; resume "
                "from the same checkpoint on another device",
                EXIT_RESUME_TO_DISAMBIGUATE,
            )
        self._clear_pending(pending["root"])
        if self._reproduced(failure, loss, first_rerun=False):
            self._record(iteration, "second_rerun_reproducible", loss, failure.message)
            self._log(
                f"Second rerun: unexpected result is reproducible on a different GPU, therefore it was likely correct "
                f"({loss} = {failure.result})"
            )
            verdict = f"Correct result (but possible Application error) ({failure.message})"
        else:
            self._record(iteration, "second_rerun_not_reproducible", loss, failure.message)
            self._log(
                f"Second rerun: unexpected result is not reproducible on a different GPU, therefore was likely "
                f"incorrect ({loss} != {failure.result})"
            )
            verdict = "Possible persistent error!"
        self._log(verdict)
        if failure.fatal:
            raise ResultValidationExit(f"iteration {iteration}: {verdict}", EXIT_FAILED_ON_RESULT_VALIDATION)
        return result

    def _check(self, loss: float | None) -> Failure | None:
        if loss is None:
            return None
        if self.injection_rate and self.injector.randrange(self.injection_rate) == 0:
            self._log(f"Injecting error type {self.injection_type.replace('_', ' ').capitalize()}", everywhere=True)
            return Failure(NAN_MESSAGE, True, loss, self.injection_type)
        if self.check_nan and not math.isfinite(loss):
            return Failure(NAN_MESSAGE, True, loss)
        if self.check_spiky and math.isfinite(loss):
            if self.samples < SPIKY_SAMPLES:
                self.samples += 1
                self.largest = max(self.largest, abs(loss))
            elif abs(loss) >= SPIKY_THRESHOLD * self.largest:
                return Failure(SPIKY_MESSAGE, False, loss)
        return None

    def _reproduced(self, failure: Failure, loss: float | None, first_rerun: bool) -> bool:
        """Whether the re-run gave the failed result again, on every rank that checked it (an
        injected fault answers as its kind says)."""
        if failure.injected is not None:
            same = failure.injected != "transient_error" if first_rerun else failure.injected == "correct_result"
        else:
            same = loss is None or relative_difference(failure.result, loss) == 0.0
        return not self._any(not same)

    def _any(self, flag: bool) -> bool:
        value = torch.tensor([float(flag)], device=self.stats_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _log(self, message: str, everywhere: bool = False) -> None:
        if everywhere:
            print(f"[rank {dist.get_rank()}, {device_identity()}] {message}", flush=True)
        elif dist.get_rank() == 0:
            print(message, flush=True)

    def _write_pending(self, iteration: int, failure: Failure) -> None:
        devices = all_gather_object(device_identity(), None)
        if dist.get_rank() == 0:
            record = {
                "iteration": iteration,
                "message": failure.message,
                "fatal": failure.fatal,
                "result": failure.result,
                "injected": failure.injected,
                "devices": devices,
            }
            with open(os.path.join(self.save_root, RERUN_STATE_FILENAME), "w", encoding="utf-8") as f:
                json.dump(record, f)
        dist.barrier()

    def load_pending(self, load_root: str, loaded_iteration: int) -> None:
        """After ``--load``: a failure recorded there for the step after ``loaded_iteration``
        (under the same world size) is re-run first."""
        path = os.path.join(load_root, RERUN_STATE_FILENAME)
        if self.mode != "validate_results" or not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if record["iteration"] != loaded_iteration + 1 or len(record["devices"]) != dist.get_world_size():
            return
        self.pending = {**record, "root": load_root}
        self._log(f"Getting the rerun state from {path}: will rerun iteration {record['iteration']}")

    def _clear_pending(self, root: str) -> None:
        dist.barrier()
        path = os.path.join(root, RERUN_STATE_FILENAME)
        if dist.get_rank() == 0 and os.path.isfile(path):
            os.remove(path)

    def _record(self, iteration: int, status: str, result: float | None, message: str) -> None:
        """One JSON line per event in --result-rejected-tracker-filename (ranks that checked)."""
        if self.tracker is None or result is None:
            return
        line = {
            "time": time.time(),
            "rank": dist.get_rank(),
            "device": device_identity(),
            "iteration": iteration,
            "status": status,
            "result": result,
            "message": message,
        }
        with open(self.tracker, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def take_determinism_report(self) -> str | None:
        """report_stats: the differences since the last report, as a log fragment."""
        if self.mode != "report_stats" or not self.differences:
            return None
        report = f"loss rerun relative difference: max {max(self.differences):.3E}"
        self.differences = []
        return report
