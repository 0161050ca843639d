"""Optimizer state in parameter geometry: the distributed optimizer's gathered state equals a
plain optimizer's, and it reshards (TP2xDP2 -> GTP2xDP2) so the next step matches the
uninterrupted run."""

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingError, write_latest_iteration
from megatron.core.dist_checkpointing.mapping import apply_factories
from megatron.core.dist_checkpointing.model_state import checkpoint_params, vocab_rows
from megatron.core.dist_checkpointing.optimizer_state import load_optimizer_state, optimizer_sharded_state_dict
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_checkpointing.tiny_models import gpt_model, layout, tokens
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import losses_by_iteration
from tests.unit_tests.training.tiny_training import train_tiny


def _trained(distributed: bool, pg):
    model = gpt_model(pg)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model, pg_collection=pg
    )
    # adam_eps well above the smallest gradients: Adam's first steps move a weight by about
    # lr * g / (|g| + eps), which for |g| near the default 1e-8 turns a one-ulp difference of g
    # (see the test) into one of the update's own size.
    config = OptimizerConfig(lr=1e-2, adam_eps=1e-4, use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(config, [ddp], pg)
    for step in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ids = tokens(seed=10 * step + pg.rank("dp"))
        model(ids, labels=ids).mean().backward()
        finalize_model_grads([ddp], pg, model.config)
        optimizer.step()
    return model, optimizer


def _param_shaped_state(distributed: bool):
    pg = layout()
    model, optimizer = _trained(distributed, pg)
    tree, _ = apply_factories(
        optimizer_sharded_state_dict(optimizer, checkpoint_params(model, "", vocab_rows(model)), pg)
    )
    flat = {}
    for by_param in tree["state"].values():
        for piece in by_param.values():
            leaves = piece.values() if isinstance(piece, dict) else [piece]
            for leaf in leaves:
                flat[(leaf.key, leaf.global_offset)] = leaf.data.clone()
    return flat, tree["param_groups"][0].data


def test_distributed_optimizer_saves_the_state_a_plain_optimizer_holds():
    distributed = run_distributed(_param_shaped_state, 2, True)
    plain = run_distributed(_param_shaped_state, 2, False)
    for (d_state, d_groups), (p_state, p_groups) in zip(distributed, plain, strict=True):
        assert d_state.keys() == p_state.keys()
        assert any(k[0].startswith("optimizer.state.exp_avg_sq.") for k in d_state)
        for key in d_state:
            # atol: ~10 ulps of the weights' scale (std 0.02 -> ulp 1.9e-9); a state in the wrong place
            # would be off by the weights' own size. The two optimizers run Adam's element-wise math
            # on differently aligned buffers, and CPUs differ in which elements take the vectorised
            # (fused multiply-add) path, so results differ by an ulp of their operands, which Adam's
            # division by sqrt(v) + eps amplifies for small gradients (an AVX2 CPU: up to 2.5e-8).
            torch.testing.assert_close(d_state[key], p_state[key], rtol=1e-6, atol=5e-8, msg=str(key))
        assert [g["step"] for g in d_groups] == [g["step"] for g in p_groups] == [2, 2]


def _mismatched_load():
    pg = layout()
    model, optimizer = _trained(False, pg)
    loaded = {"format": {"format": "param_shaped_v1", "members": 2}, "param_groups": [], "state": {}}
    try:
        load_optimizer_state(optimizer, loaded, checkpoint_params(model, "", vocab_rows(model)))
    except CheckpointingError as error:
        return str(error)


def test_loading_a_chain_of_another_length_is_refused():
    (message,) = run_distributed(_mismatched_load, 1)
    assert message == "the checkpoint holds the state of 2 chained optimizer(s) but this run has 1"


RUN = [
    "--num-layers",
    "2",
    "--lr-decay-iters",
    "4",
    "--hidden-dropout",
    "0.0",
    "--eval-iters",
    "0",
    "--use-distributed-optimizer",
    "--log-interval",
    "100",
    "--train-iters",
    "4",
]


def _losses(flags, metrics_jsonl) -> dict[int, float]:
    """Each iteration's loss, as the run's logging rank recorded it."""
    run_distributed(train_tiny, 4, RUN + flags, "gpt", 4, str(metrics_jsonl))
    return losses_by_iteration(metrics_jsonl)


def test_distributed_optimizer_state_reshards_to_another_layout(tmp_path):
    save = str(tmp_path / "tp2")
    straight = _losses(["--tensor-model-parallel-size", "2", "--save", save, "--save-interval", "2"], tmp_path / "s")
    write_latest_iteration(save, 2)
    resumed = _losses(["--generalized-tensor-parallel-size", "2", "--load", save], tmp_path / "r")
    assert sorted(resumed) == [3, 4]  # iterations 1 and 2 were restored from the checkpoint
    # step 4's loss needs the moments of step 3
    assert [resumed[3], resumed[4]] == pytest.approx([straight[3], straight[4]], rel=1e-5)
    fresh_moments = _losses(
        ["--generalized-tensor-parallel-size", "2", "--load", save, "--no-load-optim"], tmp_path / "f"
    )
    assert fresh_moments[4] != pytest.approx(straight[4], rel=1e-4)
