"""Forward-backward schedules over micro-batches: no pipelining, 1F1B and interleaved 1F1B.

A schedule calls ``forward_step_func(data_iterator, model) -> (output, loss_func)`` once per
micro-batch. On the last stage ``loss_func(output)`` returns either ``(loss, metrics)`` with a
micro-batch mean loss (backward uses ``loss / num_microbatches``) or
``(loss_sum, num_tokens, metrics)`` for per-token loss (backward uses the sum; the caller
divides the gradients by the global token count). Non-first stages receive their input via
``model.set_input_tensor``. ``model`` may be a module or a list of model chunks: one for
no pipelining and 1F1B, one per virtual stage for the interleaved schedule (which then takes
one data iterator per chunk, as Megatron's does).
``grad_scale_func`` (e.g. the fp16 optimizer's loss scaling) is applied to the loss that is
back-propagated, not to the reported metrics.

Gradient synchronization (``no_sync_func``, default ``model.no_sync`` when the model has it,
e.g. DDP) is held off for every backward pass but the last micro-batch's, so DDP's
overlapped reductions launch once per iteration, after all micro-batches have accumulated
(per chunk under interleaving: a chunk's hold ends before its own last backward).

Every schedule takes an optional :class:`~megatron.core.pipeline_parallel.timeline.PipelineTimeline`
that it fills with this rank's compute intervals (the pipeline bubble is the rest of its span).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core.errors import MegatronConfigError
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.timeline import PipelineTimeline, WaitTimer
from megatron.core.process_groups import ProcessGroupCollection


class ScheduleError(MegatronConfigError):
    """Invalid arguments to a pipeline schedule."""


def _single_chunk(model):
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ScheduleError(
            f"got {len(chunks)} model chunks; this schedule runs one, several need the interleaved schedule "
            "(get_forward_backward_func(pp, virtual_pipeline_model_parallel_size))"
        )
    return chunks[0]


def _set_input_tensor(model, tensor) -> None:
    """Feed the innermost module that accepts a stage input (wrappers such as DDP don't)."""
    target = model
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor(tensor)
    elif tensor is not None:
        raise ScheduleError(f"{type(model).__name__} has no set_input_tensor() to receive the previous stage's output")


class _MicrobatchRunner:
    """Runs one micro-batch forward (with the loss on the last stage) and its backward."""

    def __init__(
        self,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        is_last_stage,
        forward_only,
        grad_scale_func=None,
        grad_sync_hold: contextlib.ExitStack | None = None,
        timeline: PipelineTimeline | None = None,
        chunk: int = 0,
    ):
        self.forward_step_func = forward_step_func
        self.data_iterator = data_iterator
        self.model = model
        self.num_microbatches = num_microbatches
        self.is_last_stage = is_last_stage
        self.forward_only = forward_only
        self.grad_scale_func = grad_scale_func
        self.metrics: list[dict] = []
        self.num_tokens = 0
        self.grad_sync_hold = grad_sync_hold
        self.num_forward = 0
        self.num_backward = 0
        self.timeline = timeline
        self.chunk = chunk

    def forward(self, input_tensor: torch.Tensor | None) -> torch.Tensor:
        start = time.perf_counter()
        output = self._forward(input_tensor)
        if self.timeline is not None:
            self.timeline.record("forward", self.chunk, self.num_forward, start, time.perf_counter())
        self.num_forward += 1
        return output

    def _forward(self, input_tensor: torch.Tensor | None) -> torch.Tensor:
        _set_input_tensor(self.model, input_tensor)
        context = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with context:
            output, loss_func = self.forward_step_func(self.data_iterator, self.model)
            if not self.is_last_stage:
                return output
            result = loss_func(output)
        if len(result) == 3:
            loss, num_tokens, metrics = result
            self.num_tokens += int(num_tokens)
        elif len(result) == 2:
            (loss, metrics), num_tokens = result, None
            loss = loss / self.num_microbatches
        else:
            raise ScheduleError(
                f"loss_func must return (loss, metrics) or (loss, num_tokens, metrics), got {len(result)} values"
            )
        self.metrics.append(metrics)
        return self.grad_scale_func(loss) if self.grad_scale_func is not None else loss

    def backward(self, input_tensor, output_tensor, output_grad) -> torch.Tensor | None:
        start = time.perf_counter()
        self.num_backward += 1
        if self.num_backward == self.num_microbatches and self.grad_sync_hold is not None:
            self.grad_sync_hold.close()  # the last micro-batch: let its backward reduce
        if input_tensor is not None:
            input_tensor.retain_grad()
        torch.autograd.backward(output_tensor, grad_tensors=output_grad)
        if self.timeline is not None:
            self.timeline.record("backward", self.chunk, self.num_backward - 1, start, time.perf_counter())
        return input_tensor.grad if input_tensor is not None else None


@contextlib.contextmanager
def _timeline_span(timeline: PipelineTimeline | None, group=None):
    """Open and close ``timeline`` around a schedule run, after a barrier over ``group`` (the
    pipeline) at both ends so that every stage measures the same span."""
    if timeline is None:
        yield
        return
    if group is not None:
        dist.barrier(group=group)
    timeline.begin()
    yield
    if group is not None:
        WaitTimer(timeline)(dist.barrier, group)
    timeline.end()


def _hold_grad_sync(model, no_sync_func, forward_only) -> contextlib.ExitStack:
    """An exit stack inside ``no_sync_func()`` (default ``model.no_sync``); the runner closes
    it before the last micro-batch's backward. Enter it with ``with`` so an error closes it too."""
    hold = contextlib.ExitStack()
    if no_sync_func is None:
        no_sync_func = getattr(model, "no_sync", contextlib.nullcontext)
    if not forward_only:
        hold.enter_context(no_sync_func())
    return hold


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model,
    num_microbatches: int,
    forward_only: bool = False,
    no_sync_func: Callable | None = None,
    grad_scale_func: Callable | None = None,
    timeline: PipelineTimeline | None = None,
    **_unused,
) -> tuple[list[dict], int]:
    """Gradient accumulation over micro-batches on a single stage. Returns (per-micro-batch
    metrics, token count)."""
    model = _single_chunk(model)
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    with _hold_grad_sync(model, no_sync_func, forward_only) as hold, _timeline_span(timeline):
        runner = _MicrobatchRunner(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            True,
            forward_only,
            grad_scale_func,
            hold,
            timeline,
        )
        for _ in range(num_microbatches):
            loss = runner.forward(None)
            if not forward_only:
                runner.backward(None, loss, None)
    return runner.metrics, runner.num_tokens


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model,
    num_microbatches: int,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    forward_only: bool = False,
    pg_collection: ProcessGroupCollection | None = None,
    no_sync_func: Callable | None = None,
    grad_scale_func: Callable | None = None,
    timeline: PipelineTimeline | None = None,
    **_unused,
) -> tuple[list[dict], int]:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    ``tensor_shape`` is the activation shape exchanged between stages ([s, b, h], with s
    already divided by TP under sequence parallelism and by CP). Returns (per-micro-batch
    metrics, token count); both are empty/zero on non-last stages.
    """
    model = _single_chunk(model)
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    pgc = resolve_pg_collection(pg_collection)
    device = device or next(model.parameters()).device
    comm = P2PCommunicator(pgc.pp, tuple(tensor_shape), dtype, device)
    with _hold_grad_sync(model, no_sync_func, forward_only) as hold, _timeline_span(timeline, pgc.pp):
        runner = _MicrobatchRunner(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            comm.is_last_stage,
            forward_only,
            grad_scale_func,
            hold,
            timeline,
        )
        _run_1f1b(runner, comm if timeline is None else _WaitingComm(comm, timeline), num_microbatches, forward_only)
    return runner.metrics, runner.num_tokens


class _WaitingComm:
    """A P2PCommunicator whose exchanges are recorded as idle intervals of ``timeline``."""

    def __init__(self, comm: P2PCommunicator, timeline: PipelineTimeline):
        self._comm, self._wait = comm, WaitTimer(timeline)

    def __getattr__(self, name):
        value = getattr(self._comm, name)
        return (lambda *args: self._wait(value, *args)) if callable(value) else value


def _run_1f1b(runner: _MicrobatchRunner, comm: P2PCommunicator, num_microbatches: int, forward_only: bool) -> None:
    """This stage's forwards, backwards and exchanges with its neighbours in 1F1B order."""
    num_warmup = min(comm.num_stages - comm.stage - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    inputs: list = []
    outputs: list = []

    for _ in range(num_warmup):
        input_tensor = comm.recv_forward()
        output = runner.forward(input_tensor)
        comm.send_forward(output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)

    input_tensor = comm.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        last_iteration = i == num_steady - 1
        output = runner.forward(input_tensor)
        if forward_only:
            comm.send_forward(output)
            if not last_iteration:
                input_tensor = comm.recv_forward()
            continue
        output_grad = comm.send_forward_recv_backward(output)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = runner.backward(inputs.pop(0), outputs.pop(0), output_grad)
        if last_iteration:
            comm.send_backward(input_grad)
        else:
            input_tensor = comm.send_backward_recv_forward(input_grad)

    if not forward_only:
        for _ in range(num_warmup):
            output_grad = comm.recv_backward()
            input_grad = runner.backward(inputs.pop(0), outputs.pop(0), output_grad)
            comm.send_backward(input_grad)


FORWARD, BACKWARD = "forward", "backward"


def microbatch_group_error(pp_size: int, num_microbatches: int, group_size: int) -> str | None:
    """Why the interleaved schedule cannot run ``num_microbatches`` in groups of ``group_size``
    per virtual stage (Megatron's rules: ``pp_size <= group_size <= num_microbatches``, and a
    last, partial group of at least ``pp_size``); None when it can."""
    if not pp_size <= group_size <= num_microbatches:
        return (
            f"the interleaved schedule runs groups of G micro-batches through each virtual stage with "
            f"pipeline_model_parallel_size ({pp_size}) <= G <= num_microbatches ({num_microbatches}); got G = "
            f"{group_size}"
        )
    if 0 < num_microbatches % group_size < pp_size:
        return (
            f"the interleaved schedule's last group of micro-batches ({num_microbatches} % {group_size} = "
            f"{num_microbatches % group_size}) must be empty or hold at least pipeline_model_parallel_size "
            f"({pp_size}) micro-batches"
        )
    return None


def interleaved_order(
    pp_size: int,
    pp_rank: int,
    vp_size: int,
    num_microbatches: int,
    forward_only: bool = False,
    group_size: int | None = None,
) -> list[tuple[str, int, int]]:
    """The passes of pipeline rank ``pp_rank`` under the interleaved schedule, in the order it
    runs them: ``(FORWARD or BACKWARD, model chunk, micro-batch)``.

    Forwards go through the chunks in groups of ``group_size`` micro-batches (default
    ``pp_size``; Megatron's ``microbatch_group_size_per_vp_stage``): chunk 0 on micro-batches
    0..G-1, chunk 1 on the same, ..., then chunk 0 on G..2G-1; the last group holds what is
    left. Backwards go the same way from the last chunk. A warm-up of
    ``2 (pp_size - pp_rank - 1) + (vp_size - 1) G`` forwards fills the pipeline, then forwards
    and backwards alternate (steady state), then the remaining backwards drain it (cool-down).
    """
    group_size = pp_size if group_size is None else group_size
    table = [
        (chunk, microbatch)
        for start in range(0, num_microbatches, group_size)
        for chunk in range(vp_size)
        for microbatch in range(start, min(start + group_size, num_microbatches))
    ]
    total = len(table)

    def pass_(kind: str, k: int) -> tuple[str, int, int]:
        chunk, microbatch = table[k]
        return kind, vp_size - 1 - chunk if kind == BACKWARD else chunk, microbatch

    if forward_only:
        return [pass_(FORWARD, k) for k in range(total)]
    warmup = min(total, 2 * (pp_size - pp_rank - 1) + (vp_size - 1) * group_size)
    order = [pass_(FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [pass_(FORWARD, warmup + k), pass_(BACKWARD, k)]
    order += [pass_(BACKWARD, k) for k in range(total - warmup, total)]
    return order


def _destination(pass_: tuple[str, int, int], pp_rank: int, pp_size: int, vp_size: int):
    """``(pp rank, (kind, chunk, micro-batch) there)`` that a pass's result goes to: a forward's
    output to the next virtual stage, a backward's input gradient to the previous one; None at
    the ends of the pipeline."""
    kind, chunk, microbatch = pass_
    stage = chunk * pp_size + pp_rank + (1 if kind == FORWARD else -1)
    if not 0 <= stage < pp_size * vp_size:
        return None
    return stage % pp_size, (kind, stage // pp_size, microbatch)


class _Inbox:
    """Receives what the neighbouring stages send, in the order they send it (their own pass
    order, so exchanges pair up on every backend), and keeps what arrives before it is needed."""

    def __init__(
        self,
        comm: P2PCommunicator,
        pp_size: int,
        vp_size: int,
        num_microbatches: int,
        forward_only: bool,
        group_size: int,
        wait: WaitTimer,
    ):
        self.comm, self.wait = comm, wait
        ranks = dist.get_process_group_ranks(comm.pp_group)
        self.expected: dict[int, deque] = {}
        for peer in {comm.ring_prev_rank, comm.ring_next_rank}:
            peer_rank = ranks.index(peer)
            order = interleaved_order(pp_size, peer_rank, vp_size, num_microbatches, forward_only, group_size)
            sent = [_destination(p, peer_rank, pp_size, vp_size) for p in order]
            self.expected[peer] = deque(dest[1] for dest in sent if dest is not None and dest[0] == comm.stage)
        self.arrived: dict[tuple[str, int, int], torch.Tensor] = {}

    def take(self, key: tuple[str, int, int], peer: int) -> torch.Tensor:
        while key not in self.arrived:
            tensor, _ = self.wait(self.comm.post_sends_and_recv, [], peer)
            self.arrived[self.expected[peer].popleft()] = tensor
        return self.arrived.pop(key)


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: list[Iterator],
    model: list,
    num_microbatches: int,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    forward_only: bool = False,
    pg_collection: ProcessGroupCollection | None = None,
    no_sync_func: list[Callable] | None = None,
    grad_scale_func: Callable | None = None,
    timeline: PipelineTimeline | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
    **_unused,
) -> tuple[list[dict], int]:
    """Interleaved 1F1B over V model chunks per rank (chunk v of rank p is virtual stage
    ``v * PP + p``), in the order of :func:`interleaved_order`; shrinks the bubble V-fold.

    ``data_iterator`` is a list with one iterator per chunk; micro-batches go through each
    chunk in groups of ``microbatch_group_size_per_vp_stage`` (default: the pipeline size;
    :func:`microbatch_group_error` says which sizes run), ``no_sync_func`` None (each chunk's own
    ``no_sync``) or one callable per chunk. Results are sent as soon as they exist and inputs
    received when a pass needs them. Returns (per-micro-batch metrics, token count) of the
    last virtual stage; empty/zero on other ranks.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    vp_size = len(chunks)
    pgc = resolve_pg_collection(pg_collection)
    pp_size = pgc.size("pp")
    group_size = pp_size if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
    error = microbatch_group_error(pp_size, num_microbatches, group_size)
    if error is not None:
        raise ScheduleError(error)
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != vp_size:
        raise ScheduleError(f"the interleaved schedule takes a list of one data iterator per model chunk ({vp_size})")
    no_sync_funcs = [None] * vp_size if no_sync_func is None else list(no_sync_func)
    if len(no_sync_funcs) != vp_size:
        raise ScheduleError(f"no_sync_func must be None or one callable per model chunk ({vp_size})")
    device = device or next(chunks[0].parameters()).device
    comm = P2PCommunicator(pgc.pp, tuple(tensor_shape), dtype, device)
    pp_rank = comm.stage
    num_stages = pp_size * vp_size

    with contextlib.ExitStack() as stack:
        runners = []
        for chunk, (module, iterator, no_sync) in enumerate(zip(chunks, data_iterator, no_sync_funcs, strict=True)):
            hold = stack.enter_context(_hold_grad_sync(module, no_sync, forward_only))
            is_last = chunk * pp_size + pp_rank == num_stages - 1
            runners.append(
                _MicrobatchRunner(
                    forward_step_func,
                    iterator,
                    module,
                    num_microbatches,
                    is_last,
                    forward_only,
                    grad_scale_func,
                    hold,
                    timeline,
                    chunk,
                )
            )
        stack.enter_context(_timeline_span(timeline, pgc.pp))
        wait = WaitTimer(timeline)
        inbox = _Inbox(comm, pp_size, vp_size, num_microbatches, forward_only, group_size, wait)
        inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        sends = []
        for pass_ in interleaved_order(pp_size, pp_rank, vp_size, num_microbatches, forward_only, group_size):
            kind, chunk, microbatch = pass_
            stage = chunk * pp_size + pp_rank
            if kind == FORWARD:
                input_tensor = None
                if stage > 0:
                    input_tensor = inbox.take(pass_, comm.ring_prev_rank).requires_grad_()
                result = runners[chunk].forward(input_tensor)
                if not forward_only:
                    inputs[chunk, microbatch], outputs[chunk, microbatch] = input_tensor, result
                peer = comm.ring_next_rank
            else:
                output_grad = inbox.take(pass_, comm.ring_next_rank) if stage < num_stages - 1 else None
                input_tensor = inputs.pop((chunk, microbatch))
                result = runners[chunk].backward(input_tensor, outputs.pop((chunk, microbatch)), output_grad)
                peer = comm.ring_prev_rank
            if _destination(pass_, pp_rank, pp_size, vp_size) is not None:
                sends = [send for send in sends if not send[0].is_completed()]  # let finished buffers go
                sends += comm.post_sends_and_recv([(result.detach(), peer)], None)[1]
        for work, _ in sends:
            wait(work.wait)
    last = runners[-1]
    return last.metrics, last.num_tokens


def get_forward_backward_func(
    pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int | None = None
):
    """The schedule for a layout: no pipelining at PP=1, 1F1B, or interleaved 1F1B with
    virtual stages (V > 1, PP > 1)."""
    if virtual_pipeline_model_parallel_size not in (None, 1):
        if pipeline_model_parallel_size == 1:
            raise ScheduleError(
                f"virtual_pipeline_model_parallel_size ({virtual_pipeline_model_parallel_size}) needs "
                "pipeline_model_parallel_size > 1"
            )
        return forward_backward_pipelining_with_interleaving
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    return forward_backward_pipelining_without_interleaving
