"""What the loop does around its steps: Megatron's exit rules (--exit-interval,
--exit-duration-in-mins, --exit-signal-handler), manual garbage collection (--manual-gc),
profiling (--profile) and the weight check across data-parallel replicas
(--check-weight-hash-across-dp-replicas-interval)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import signal
import time

import torch
import torch.distributed as dist

from megatron.core.errors import MegatronRuntimeError
from megatron.core.optimizer.clip_grads import stats_device


class ExitRule:
    """When to stop early: at a multiple of ``interval`` iterations, once ``duration_min``
    minutes have passed since the rule was made, or once any rank has received ``exit_signal``
    (--exit-signal-handler; the rule handles that signal until :meth:`close`). Time and signal are
    decided together: every rank joins one MAX all-reduce each iteration, so all stop at the
    same iteration."""

    def __init__(
        self, interval: int | None, duration_min: float | None, device, exit_signal: signal.Signals | None = None
    ):
        self.interval, self.duration_min, self.device = interval, duration_min, device
        self.start = time.monotonic()
        self.exit_signal, self._signalled = exit_signal, False
        self._previous_handler = None
        if exit_signal is not None:
            self._previous_handler = signal.signal(exit_signal, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def reason(self, iteration: int) -> str | None:
        """Why the run stops after ``iteration`` (a phrase for the log line), or None."""
        if self.duration_min is not None or self.exit_signal is not None:
            minutes = (time.monotonic() - self.start) / 60
            over = self.duration_min is not None and minutes > self.duration_min
            flags = torch.tensor([float(over), float(self._signalled)], device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            over, signalled = flags.tolist()
            if signalled:
                return f"on {self.exit_signal.name} (--exit-signal-handler)"
            if over:
                return f"after {minutes:.2f} minutes (--exit-duration-in-mins {self.duration_min:g})"
        if self.interval is not None and iteration % self.interval == 0:
            return f"at iteration {iteration} (--exit-interval {self.interval})"
        return None

    def close(self) -> None:
        """Give the signal back to the handler it had before this rule."""
        if self.exit_signal is not None:
            signal.signal(self.exit_signal, self._previous_handler)
            self.exit_signal = None


class GarbageCollection:
    """With ``manual`` (--manual-gc) Python's automatic collector is off for the run and a
    full collection runs every ``interval`` iterations (0: never) and, with ``around_eval``,
    before each evaluation, then a young-generation one after it, as in Megatron."""

    def __init__(self, manual: bool, interval: int, around_eval: bool):
        self.manual, self.interval, self.around_eval = manual, interval, around_eval
        self._was_enabled = gc.isenabled()
        if manual:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.manual and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self):
        if self.manual and self.around_eval:
            gc.collect()
        yield
        if self.manual and self.around_eval:
            gc.collect(generation=0)

    def close(self) -> None:
        """Give the collector back as it was before the run."""
        if self.manual and self._was_enabled:
            gc.enable()


class IterationProfiler:
    """--profile: iterations [start, end) of the ranks in --profile-ranks are profiled. With
    --use-pytorch-profiler by torch.profiler, the trace written to --tensorboard-dir (the
    working directory without one); otherwise they are the capture range of an outside
    profiler (nsys --capture-range=cudaProfilerApi), which needs CUDA."""

    def __init__(self, start: int, end: int, use_torch: bool, trace_dir: str | None, device, enabled: bool):
        self.start, self.end, self.use_torch, self.device = start, end, use_torch, device
        self.enabled = enabled
        self._torch = None
        self._trace_dir = trace_dir or "."

    @classmethod
    def from_args(cls, args, device) -> IterationProfiler:
        enabled = bool(args.profile) and dist.get_rank() in args.profile_ranks
        if enabled and not args.use_pytorch_profiler and device.type != "cuda":
            print(
                "--profile without --use-pytorch-profiler marks a CUDA profiler capture range; "
                "there is none on CPU (add --use-pytorch-profiler for a torch.profiler trace)",
                flush=True,
            )
            enabled = False
        return cls(
            args.profile_step_start,
            args.profile_step_end,
            args.use_pytorch_profiler,
            args.tensorboard_dir,
            device,
            enabled,
        )

    def before_step(self, iteration: int) -> None:
        if not self.enabled or iteration != self.start:
            return
        if self.use_torch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self._trace_dir),
            )
            self._torch.__enter__()
        else:
            torch.cuda.cudart().cudaProfilerStart()

    def after_step(self, iteration: int) -> None:
        if self.enabled and iteration == self.end - 1:
            self.close()

    def close(self) -> None:
        """Stop profiling if it is running (the trace is written now)."""
        if not self.enabled:
            return
        self.enabled = False
        if self._torch is not None:
            self._torch.__exit__(None, None, None)
            self._torch = None
        elif not self.use_torch:
            torch.cuda.cudart().cudaProfilerStop()


class ReplicaDivergedError(MegatronRuntimeError):
    """Replicas that must hold the same weights (data-parallel, or tensor-parallel copies of the
    weights TP does not shard) do not."""


def check_replica_weights(model_chunks, pgc, iteration: int, flag: str, tensor_parallel: bool = False) -> None:
    """Megatron's weight-hash check: every data-parallel replica of this rank's weights holds the
    same bytes. Dense weights are compared over ``dp_cp``, expert weights over the expert data
    group; with ``tensor_parallel`` (Megatron's --test-mode) also the weights TP does not shard
    over ``tp`` (experts' over ``expt_tp``). Every rank sees every digest, so all raise together,
    naming the ranks that differ and ``flag``, the option that asked for the check."""
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    checks = [("dense", "data-parallel", False, pgc.dp_cp), ("expert", "data-parallel", True, pgc.expert_dp_group())]
    if tensor_parallel:
        expert_tp = pgc.expt_tp if pgc.has("expt_tp") else pgc.tp
        checks += [("dense", "tensor-parallel", False, pgc.tp), ("expert", "expert tensor-parallel", True, expert_tp)]
    for kind, replicas, is_expert, group in checks:
        if dist.get_world_size(group) == 1:
            continue
        digest = hashlib.sha256()
        for param in params:
            shared = replicas == "data-parallel" or not getattr(param, "tensor_model_parallel", False)
            if getattr(param, "is_expert", False) == is_expert and shared:
                digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        mine = torch.tensor(list(digest.digest()), dtype=torch.uint8, device=stats_device(group))
        digests = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(digests, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        differ = [rank for rank, other in zip(ranks, digests, strict=True) if not torch.equal(other, digests[0])]
        if differ:
            raise ReplicaDivergedError(
                f"iteration {iteration}: the {kind} weights of {replicas} replicas differ: ranks {differ} "
                f"disagree with rank {ranks[0]} ({flag})"
            )
