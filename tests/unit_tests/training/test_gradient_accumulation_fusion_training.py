"""Gradient accumulation fusion through the real Trainer and schedules: with the linear layers'
wgrad GEMMs accumulating straight into DDP's ``main_grad`` (run on CPU inside
``fusion_devices("cpu")``: the same calls as on CUDA, fp32 operands and buffer) one iteration of
four micro-batches gives the loss and the finalized ``main_grad`` of every parameter of the
unfused run (``--no-gradient-accumulation-fusion``), on TP2 with sequence parallelism and full
activation recomputation, and on PP2 (1F1B) with the embeddings tied across the two stages. Every
linear weight of the rank took the fused path once per micro-batch (the tied output layer's into
the embedding's ``main_grad``), and none did without the flag."""

import collections

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed.main_grad import fusion_devices
from megatron.core.tensor_parallel import layers
from megatron.training.arguments import parse_args
from megatron.training.initialize import initialize_megatron, set_random_seeds
from megatron.training.training import Trainer
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.tiny_training import TINY_RUN

MICRO_BATCHES = 4  # global batch 8 of micro-batch 2 on one data-parallel replica
FLAGS = TINY_RUN + ["--num-layers", "2", "--train-iters", "1", "--eval-iters", "0", "--hidden-dropout", "0.0"]
LAYOUTS = {
    "TP2-SP-recompute": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full"],
    "PP2-tied": ["--pipeline-model-parallel-size", "2"],
}


def _one_iteration(flags, monkeypatch):
    """One train step: its loss, every parameter's main_grad, the fused accumulations per
    parameter and the parameters of this rank's linear layers (by name)."""
    args = parse_args(FLAGS + flags, model_family="gpt", world_size=2)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    pgc = initialize_megatron(args)
    set_random_seeds(args.seed, pgc)
    trainer = Trainer(args, pgc)
    module = trainer.model.module
    name_of = {id(p.main_grad): name for name, p in module.named_parameters()}
    fused = collections.Counter()
    accumulate = layers.add_product_to_main_grad

    def counting(main_grad, mat1, mat2):
        fused[name_of[id(main_grad)]] += 1
        accumulate(main_grad, mat1, mat2)

    monkeypatch.setattr(layers, "add_product_to_main_grad", counting)
    loss, *_ = trainer.train_step(trainer.data_iterator(trainer.train_ds, 0))
    grads = {name: p.main_grad.clone() for name, p in module.named_parameters()}
    name_of_param = {id(p): name for name, p in module.named_parameters()}
    linear_weights = {
        name_of_param[id(m.weight)]
        for m in module.modules()
        if isinstance(m, layers.ColumnParallelLinear | layers.RowParallelLinear)
    }
    return loss, grads, dict(fused), linear_weights


def _fused_and_unfused(flags):
    with pytest.MonkeyPatch.context() as monkeypatch, fusion_devices("cpu"):
        fused = _one_iteration(flags, monkeypatch)
    with pytest.MonkeyPatch.context() as monkeypatch, fusion_devices("cpu"):
        unfused = _one_iteration(flags + ["--no-gradient-accumulation-fusion"], monkeypatch)
    return fused, unfused


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_wgrad_accumulation_gives_the_unfused_gradients(layout):
    for fused, unfused in run_distributed(_fused_and_unfused, 2, LAYOUTS[layout]):
        (loss, grads, counts, linear_weights), (ref_loss, ref_grads, ref_counts, _) = fused, unfused
        assert loss == ref_loss  # the forward is the same computation
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        assert ref_counts == {}
        assert counts == dict.fromkeys(linear_weights, MICRO_BATCHES)
