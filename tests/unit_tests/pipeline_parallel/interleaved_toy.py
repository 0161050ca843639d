"""A toy pipeline of tanh(linear) layers (the benchmark's, optionally sleep-padded) split into
virtual stages, and its single-process reference, shared by the interleaved-schedule tests of
every world size."""

import torch

from benchmarks.pipeline_bubble import ToyStage, toy_forward_step
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.pipeline_parallel.timeline import PipelineTimeline
from tests.unit_tests.dist_harness import device

HIDDEN, SEQ, MBS = 6, 3, 2


def full_layers(num_layers):
    torch.manual_seed(0)
    return [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(num_layers)]


def microbatches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SEQ, MBS, HIDDEN, generator=g), torch.randn(SEQ, MBS, HIDDEN, generator=g)) for _ in range(n)]


def plain_loop(num_layers, num_microbatches):
    """Losses and gradients (layer order) of a single-process loop over the micro-batches."""
    layers = full_layers(num_layers)
    losses = []
    for x, target in microbatches(num_microbatches):
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = ((h - target) ** 2).mean()
        (loss / num_microbatches).backward()
        losses.append(loss.item())
    return losses, [[p.grad.clone() for p in layer.parameters()] for layer in layers]


def pipelined(pp, vp, num_layers, num_microbatches, forward_only=False, sleep_s=0.0, group_size=None):
    """Run the toy on this rank (interleaved when ``vp`` > 1, in micro-batch groups of
    ``group_size``, else 1F1B); returns
    (pp rank, losses, {global layer index: grads}, idle fraction of the timeline)."""
    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    rank = pgc.rank("pp")
    per_stage = num_layers // (pp * vp)
    layers = full_layers(num_layers)
    chunks, owned = [], {}
    for v in range(vp):
        first = (v * pp + rank) * per_stage
        owned.update({first + i: (v, i) for i in range(per_stage)})
        chunks.append(ToyStage(layers[first : first + per_stage], first == 0, sleep_s).to(device()))
    batches = [(x.to(device()), t.to(device())) for x, t in microbatches(num_microbatches)]
    timeline = PipelineTimeline()
    kwargs = dict(
        forward_step_func=toy_forward_step,
        num_microbatches=num_microbatches,
        tensor_shape=(SEQ, MBS, HIDDEN),
        forward_only=forward_only,
        pg_collection=pgc,
        timeline=timeline,
    )
    if vp > 1:
        schedule = forward_backward_pipelining_with_interleaving
        kwargs.update(
            model=chunks,
            data_iterator=[iter(batches) for _ in chunks],
            microbatch_group_size_per_vp_stage=group_size,
        )
    else:
        schedule = forward_backward_pipelining_without_interleaving
        kwargs.update(model=chunks, data_iterator=iter(batches))
    metrics, _ = schedule(**kwargs)
    grads = {}
    if not forward_only:
        for index, (v, i) in owned.items():
            grads[index] = [p.grad.cpu() for p in chunks[v].layers[i].parameters()]
    return rank, [m["loss"] for m in metrics], grads, timeline.idle_fraction
