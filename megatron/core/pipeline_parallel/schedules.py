"""Forward-backward schedules over micro-batches: no pipelining and 1F1B.

A schedule calls ``forward_step_func(data_iterator, model) -> (output, loss_func)`` once per
micro-batch. On the last stage ``loss_func(output)`` returns either ``(loss, metrics)`` with a
micro-batch mean loss (backward uses ``loss / num_microbatches``) or
``(loss_sum, num_tokens, metrics)`` for per-token loss (backward uses the sum; the caller
divides the gradients by the global token count). Non-first stages receive their input via
``model.set_input_tensor``. ``model`` may be a module or a list of model chunks (one chunk per
virtual stage; interleaving is not implemented yet, so the list must have one element).
``grad_scale_func`` (e.g. the fp16 optimizer's loss scaling) is applied to the loss that is
back-propagated, not to the reported metrics.

Gradient synchronization (``no_sync_func``, default ``model.no_sync`` when the model has it,
e.g. DDP) is held off for every backward pass but the last micro-batch's, so DDP's
overlapped reductions launch once per iteration, after all micro-batches have accumulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from megatron.core.errors import MegatronConfigError
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups import ProcessGroupCollection


class ScheduleError(MegatronConfigError):
    """Invalid arguments to a pipeline schedule."""


def _single_chunk(model):
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ScheduleError(
            f"got {len(chunks)} model chunks; interleaved (virtual) pipelining is not implemented yet, pass one chunk"
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
        self.num_backward = 0

    def forward(self, input_tensor: torch.Tensor | None) -> torch.Tensor:
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
        self.num_backward += 1
        if self.num_backward == self.num_microbatches and self.grad_sync_hold is not None:
            self.grad_sync_hold.close()  # the last micro-batch: let its backward reduce
        if input_tensor is not None:
            input_tensor.retain_grad()
        torch.autograd.backward(output_tensor, grad_tensors=output_grad)
        return input_tensor.grad if input_tensor is not None else None


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
    **_unused,
) -> tuple[list[dict], int]:
    """Gradient accumulation over micro-batches on a single stage. Returns (per-micro-batch
    metrics, token count)."""
    model = _single_chunk(model)
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    with _hold_grad_sync(model, no_sync_func, forward_only) as hold:
        runner = _MicrobatchRunner(
            forward_step_func, data_iterator, model, num_microbatches, True, forward_only, grad_scale_func, hold
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
    with _hold_grad_sync(model, no_sync_func, forward_only) as hold:
        runner = _MicrobatchRunner(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            comm.is_last_stage,
            forward_only,
            grad_scale_func,
            hold,
        )
        _run_1f1b(runner, comm, num_microbatches, forward_only)
    return runner.metrics, runner.num_tokens


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


def get_forward_backward_func(
    pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int | None = None
):
    """The schedule for a layout: no pipelining at PP=1, 1F1B otherwise."""
    if virtual_pipeline_model_parallel_size not in (None, 1):
        raise ScheduleError("interleaved (virtual) pipeline schedules are not implemented yet")
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    return forward_backward_pipelining_without_interleaving
