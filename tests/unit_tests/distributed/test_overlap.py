"""The overlap really overlaps: with ``overlap_grad_reduce`` a bucket's reduction is launched
as soon as its layer's backward is done, before the backward of earlier layers; with
``overlap_param_gather`` each bucket's all-gather is waited on just before the first layer
that uses it. The order of events is recorded (no timing). With one replica nothing is hooked."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.config import ModelParallelConfig
from megatron.core.distributed import DistributedConfigError, DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.main_grad import fusion_devices
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.tensor_parallel import ColumnParallelLinear, layers
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.tensor_parallel.helpers import tp_config

NUM_LAYERS, WIDTH = 4, 8
LAYER_NUMEL = WIDTH * WIDTH + WIDTH  # a bucket of this size holds exactly one layer


def _layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(NUM_LAYERS)]).to(device())


class _ParallelLayers(torch.nn.Sequential):
    """The same stack of our column-parallel linears (TP 1), whose wgrad GEMMs accumulate straight
    into DDP's main_grad (gradient accumulation fusion)."""

    def __init__(self):
        torch.manual_seed(0)
        pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(dist.get_world_size()))
        init = torch.nn.init.normal_
        super().__init__(
            *[
                ColumnParallelLinear(WIDTH, WIDTH, config=tp_config(), init_method=init, pg_collection=pgc)
                for _ in range(NUM_LAYERS)
            ]
        )
        self.to(device())

    def forward(self, x):
        for layer in self:
            x = layer(x)[0]
        return x


def _loss(model, step=0):
    gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
    x = torch.randn(4, WIDTH, generator=gen).to(device())
    return torch.tanh(model(x)).pow(2).mean()


class _Recorder:
    """Records collectives launched on the buckets (and waits on their handles) as events,
    interleaved with whatever else the test records."""

    def __init__(self, ddp, monkeypatch):
        (buffer,) = ddp.param_and_grad_buffers
        self.buckets = buffer.buckets
        self.events: list[tuple] = []
        for name in ("all_reduce", "all_gather"):
            monkeypatch.setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _bucket_index(self, tensor) -> int | None:
        for bucket in self.buckets:
            for data in (bucket.grad_data, bucket.param_data):
                if data is not None and tensor.data_ptr() == data.data_ptr():
                    return bucket.index
        return None

    def _wrap(self, name, collective):
        recorder = self

        class Handle:
            def __init__(self, work, index):
                self.work, self.index = work, index

            def wait(self):
                recorder.events.append(("wait " + name, self.index))
                return self.work.wait()

        def launch(tensor, *args, **kwargs):
            index = self._bucket_index(tensor[0] if isinstance(tensor, list) else tensor)
            self.events.append((name, index))
            work = collective(tensor, *args, **kwargs)
            return Handle(work, index) if kwargs.get("async_op") else work

        return launch


def _grad_events(overlap, monkeypatch, build=_layers):
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(2))
    model = build()
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=LAYER_NUMEL)
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model, pg_collection=pgc)
    recorder = _Recorder(ddp, monkeypatch)
    for index, layer in enumerate(model):
        layer.weight.register_hook(lambda grad, index=index: recorder.events.append(("grad", index)))
    _loss(ddp).backward()
    recorder.events.append(("backward done", None))
    ddp.finish_grad_sync()
    return recorder.events


# Buckets are in reverse layer order: bucket 0 holds the last layer, bucket 3 the first.
OVERLAPPED = [
    ("grad", 3),
    ("all_reduce", 0),
    ("grad", 2),
    ("all_reduce", 1),
    ("grad", 1),
    ("all_reduce", 2),
    ("grad", 0),
    ("all_reduce", 3),
    ("backward done", None),
    *[("wait all_reduce", b) for b in range(4)],
]
NOT_OVERLAPPED = [
    *[("grad", layer) for layer in (3, 2, 1, 0)],
    ("backward done", None),
    *[("all_reduce", b) for b in range(4)],
    *[("wait all_reduce", b) for b in range(4)],
]


@pytest.mark.parametrize("overlap, expected", [(True, OVERLAPPED), (False, NOT_OVERLAPPED)], ids=["on", "off"])
def test_each_bucket_is_reduced_while_earlier_layers_are_still_in_backward(overlap, expected):
    def events():
        with pytest.MonkeyPatch.context() as monkeypatch:
            return _grad_events(overlap, monkeypatch)

    assert run_distributed(events, 2) == [expected, expected]


def test_fused_wgrad_accumulation_marks_each_parameter_ready_once_as_its_backward_ends():
    """The linears' weight gradients reach DDP as placeholders (the GEMM already accumulated into
    main_grad): each bucket is still launched once, as soon as its layer's backward is done."""

    def events():
        with pytest.MonkeyPatch.context() as monkeypatch, fusion_devices(device().type):
            calls = []
            accumulate = layers.add_product_to_main_grad
            monkeypatch.setattr(layers, "add_product_to_main_grad", lambda *a: calls.append(1) or accumulate(*a))
            return _grad_events(True, monkeypatch, _ParallelLayers), len(calls)

    assert run_distributed(events, 2) == [(OVERLAPPED, NUM_LAYERS)] * 2


def _param_gather_events(monkeypatch):
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(2))
    model = _layers()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        bucket_size=LAYER_NUMEL,
    )
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model, pg_collection=pgc)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, use_distributed_optimizer=True), [ddp], pgc)
    recorder = _Recorder(ddp, monkeypatch)
    for index, layer in enumerate(model):  # registered after DDP's pre-hooks, so they run after them
        layer.register_forward_pre_hook(lambda module, args, index=index: recorder.events.append(("forward", index)))
    _loss(ddp).backward()
    ddp.finish_grad_sync()
    optimizer.step()
    recorder.events.append(("step done", None))
    loss = _loss(ddp, step=1)
    return [e for e in recorder.events if e[0] != "all_reduce" and e[0] != "wait all_reduce"], loss.item()


def test_each_bucket_is_gathered_while_earlier_layers_run_forward():
    def events():
        with pytest.MonkeyPatch.context() as monkeypatch:
            return _param_gather_events(monkeypatch)

    forward = [("forward", layer) for layer in range(4)]
    expected = [
        # the step launches every gather, in forward order (the first layer lives in bucket 3)
        *[("all_gather", bucket) for bucket in (3, 2, 1, 0)],
        ("step done", None),
        *[event for layer in range(4) for event in (("wait all_gather", 3 - layer), ("forward", layer))],
    ]
    results = run_distributed(events, 2)
    # the first forward found nothing to wait for; the one after the step waits bucket by bucket
    assert [events for events, _ in results] == [forward + expected] * 2
    assert all(loss > 0 for _, loss in results)


def _nothing_hooked_on_one_replica():
    pgc = ProcessGroupCollection.from_layout(RankLayout.for_world(1))
    model = _layers()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=LAYER_NUMEL
    )
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model, pg_collection=pgc)
    assert not any(module._forward_pre_hooks for module in model.modules())
    _loss(ddp).backward()
    (buffer,) = ddp.param_and_grad_buffers
    return [bucket.launched for bucket in buffer.buckets]


def test_one_replica_installs_no_forward_hooks_and_launches_nothing_in_backward():
    assert run_distributed(_nothing_hooked_on_one_replica, 1) == [[False] * NUM_LAYERS]


def test_overlap_param_gather_needs_the_distributed_optimizer():
    with pytest.raises(DistributedConfigError, match="overlap_param_gather needs use_distributed_optimizer"):
        DistributedDataParallelConfig(overlap_param_gather=True)


def test_bf16_and_fp32_grad_reduction_are_exclusive():
    with pytest.raises(DistributedConfigError, match="grad_reduce_in_fp32 and grad_reduce_in_bf16 are both set"):
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, grad_reduce_in_bf16=True)
