"""1F1B and no-pipelining schedules give the losses and gradients of a plain single-process
loop over the same micro-batches."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    ScheduleError,
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
from tests.unit_tests.dist_harness import device, run_distributed

HIDDEN, SEQ, MBS, NUM_LAYERS = 6, 3, 2, 4


def _full_layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(NUM_LAYERS)]


def _microbatches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SEQ, MBS, HIDDEN, generator=g), torch.randn(SEQ, MBS, HIDDEN, generator=g)) for _ in range(n)]


class Stage(torch.nn.Module):
    """A stage of a toy pipeline: its slice of tanh(linear) layers."""

    def __init__(self, layers, first):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.first = first
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.first else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def _forward_step(data_iterator, model):
    x, target = next(data_iterator)
    out = model(x)

    def loss_func(output):
        loss = ((output - target) ** 2).mean()
        return loss, {"loss": loss.detach().item()}

    return out, loss_func


def _reference(num_microbatches):
    model = Stage(_full_layers(), first=True)
    metrics, _ = forward_backward_no_pipelining(
        forward_step_func=_forward_step,
        data_iterator=iter(_microbatches(num_microbatches)),
        model=model,
        num_microbatches=num_microbatches,
    )
    return [m["loss"] for m in metrics], [p.grad.clone() for p in model.parameters()]


def _plain_loop(num_microbatches):
    layers = _full_layers()
    losses = []
    for x, target in _microbatches(num_microbatches):
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = ((h - target) ** 2).mean()
        (loss / num_microbatches).backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for layer in layers for p in layer.parameters()]


def _pipelined(pp, num_microbatches, forward_only):
    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    stage = pgc.rank("pp")
    per_stage = NUM_LAYERS // pp
    layers = _full_layers()[stage * per_stage : (stage + 1) * per_stage]
    model = Stage(layers, first=stage == 0).to(device())
    batches = [(x.to(device()), t.to(device())) for x, t in _microbatches(num_microbatches)]
    metrics, _ = forward_backward_pipelining_without_interleaving(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=num_microbatches,
        tensor_shape=(SEQ, MBS, HIDDEN),
        forward_only=forward_only,
        pg_collection=pgc,
    )
    grads = None if forward_only else [p.grad.cpu() for p in model.parameters()]
    return stage, [m["loss"] for m in metrics], grads


def test_no_pipelining_equals_plain_loop():
    losses, grads = _reference(3)
    plain_losses, plain_grads = _plain_loop(3)
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pp,num_microbatches", [(2, 1), (2, 3), (4, 2), (4, 6)])
def test_1f1b_matches_single_process(pp, num_microbatches):
    ref_losses, ref_grads = _plain_loop(num_microbatches)
    results = run_distributed(_pipelined, pp, pp, num_microbatches, False)
    per_stage = len(ref_grads) // pp
    for stage, losses, grads in results:
        if stage == pp - 1:
            assert losses == pytest.approx(ref_losses, rel=1e-6)
        else:
            assert losses == []
        for got, want in zip(grads, ref_grads[stage * per_stage : (stage + 1) * per_stage], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_1f1b_forward_only_returns_losses_without_grads():
    ref_losses, _ = _plain_loop(3)
    results = run_distributed(_pipelined, 2, 2, 3, True)
    assert results[1][1] == pytest.approx(ref_losses, rel=1e-6)
    assert results[0][2] is None


def test_schedule_selection_and_errors():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(4) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 1) is forward_backward_pipelining_without_interleaving
    with pytest.raises(ScheduleError, match="got 2 model chunks; .* need the interleaved schedule"):
        forward_backward_no_pipelining(forward_step_func=None, data_iterator=None, model=[1, 2], num_microbatches=1)
    with pytest.raises(ScheduleError, match="num_microbatches must be >= 1, got 0"):
        forward_backward_no_pipelining(
            forward_step_func=None, data_iterator=None, model=Stage([], True), num_microbatches=0
        )
