"""--position-embedding-type yarn and its Megatron flags through the trainer: the fields reach
the model record, TP2 trains the single-process curve, a checkpoint resumes with no model flags
(the record keeps YaRN), and partial rotation is refused."""

import pytest

from megatron.training.arguments import ArgumentError, model_record_from_args
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny

RUN = [*CURVE_RUN, "--num-layers", "2", "--eval-iters", "0", "--log-interval", "1"]
YARN = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "2.0"]
YARN += ["--yarn-original-max-position-embeddings", "8", "--no-yarn-correction-range-round-to-int"]


def test_the_flags_reach_the_model_record():
    config = model_record_from_args(tiny_args(RUN + YARN + ["--train-iters", "4"]), 64).config
    assert (config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim) == (4.0, 2.0, 0.0)
    assert (config.yarn_original_max_position_embeddings, config.yarn_correction_range_round_to_int) == (8, False)
    assert (config.yarn_beta_fast, config.yarn_beta_slow) == (32.0, 1.0)
    rope = model_record_from_args(tiny_args(RUN + ["--train-iters", "4", "--position-embedding-type", "rope"]), 64)
    assert rope.config.yarn_rotary_scaling_factor is None


def test_tp2_trains_the_single_process_curve_and_resumes_without_model_flags(tmp_path):
    save = str(tmp_path / "ckpt")
    single = tmp_path / "single.jsonl"
    run_distributed(train_tiny, 1, RUN + YARN + ["--train-iters", "4"], "gpt", 1, single)
    tp2 = (
        RUN + YARN + ["--train-iters", "4", "--tensor-model-parallel-size", "2", "--save", save, "--save-interval", "2"]
    )
    run_distributed(train_tiny, 2, tp2, "gpt", 2, tmp_path / "tp2.jsonl")
    assert loss_curve(tmp_path / "tp2.jsonl") == pytest.approx(loss_curve(single), rel=1e-5)
    from megatron.core.dist_checkpointing import write_latest_iteration

    write_latest_iteration(save, 2)
    run_distributed(train_tiny, 1, RUN + ["--train-iters", "4", "--load", save], "gpt", 1, tmp_path / "resumed.jsonl")
    resumed = losses_by_iteration(tmp_path / "resumed.jsonl")
    assert [resumed[3], resumed[4]] == pytest.approx(loss_curve(single)[2:], rel=1e-5)


def test_yarn_rotates_whole_heads_only():
    with pytest.raises(ArgumentError, match="^--position-embedding-type yarn rotates whole heads"):
        tiny_args(RUN + YARN + ["--train-iters", "4", "--rotary-percent", "0.5"])
