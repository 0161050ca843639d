"""Training through the fused output layer + cross-entropy: the real Trainer and schedule on
TP2 with sequence parallelism (the output layer's input gathered over the sequence, the vocabulary
split) give the losses and final parameters of ``--cross-entropy-fusion-impl native`` (logits,
then the cross-entropy kernel), which turns the fusion off on the model: the loss, the gradient
norm and the parameters after a step."""

import json

import torch
import torch.distributed as dist

from megatron.core.fusions import fusion_backend
from megatron.training.arguments import parse_args
from megatron.training.initialize import initialize_megatron, set_random_seeds
from megatron.training.training import Trainer, logging_rank
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.tiny_training import TINY_RUN

FLAGS = TINY_RUN + [
    "--num-layers",
    "1",
    "--train-iters",
    "1",
    "--global-batch-size",
    "2",
    "--hidden-dropout",
    "0.0",
    "--eval-iters",
    "0",
]
FLAGS += ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--log-interval", "1"]
# Only the fused linear cross-entropy switched on, its per-chunk math on torch ops (the kernels are
# test_linear_cross_entropy.py's): the runs differ only in how the loss is formed.
TORCH_OPS = ["norm", "bias_dropout_add", "activation", "rope", "cross_entropy", "linear_bias"]


def _args(tmp_dir, impl):
    return parse_args(
        FLAGS + ["--cross-entropy-fusion-impl", impl, "--metrics-jsonl", f"{tmp_dir}/{impl}.jsonl"],
        model_family="gpt",
        world_size=2,
    )


def _train(args, pgc):
    set_random_seeds(args.seed, pgc)
    with fusion_backend("triton", disabled_ops=TORCH_OPS):
        trainer = Trainer(args, pgc)
        trainer.train()
    trainer.logger.close()
    losses = None
    if dist.get_rank() == logging_rank(pgc):  # the loss and the gradient norm (Adam's update hides a scale)
        with open(args.metrics_jsonl, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        losses = [value for r in records if r["type"] == "train" for value in (r["lm loss"], r["grad_norm"])]
    params = [p.detach().clone() for p in trainer.model.module.parameters()]
    return trainer.model.module.linear_cross_entropy, losses, params


def _both(tmp_dir):
    fused, native = _args(tmp_dir, "linear"), _args(tmp_dir, "native")
    pgc = initialize_megatron(fused)
    return _train(fused, pgc), _train(native, pgc)


def test_fused_linear_cross_entropy_trains_like_the_logits_path_on_tp2_sequence_parallel(tmp_path):
    for (fused, fused_losses, fused_params), (native, native_losses, native_params) in run_distributed(
        _both, 2, str(tmp_path)
    ):
        assert fused and not native
        if fused_losses is not None:
            assert len(fused_losses) == 2
            torch.testing.assert_close(fused_losses, native_losses, rtol=1e-5, atol=1e-6)
        for a, b in zip(fused_params, native_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
