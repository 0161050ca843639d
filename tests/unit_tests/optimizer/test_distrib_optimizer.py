"""DistributedOptimizer: each dp_cp replica holds only its share of masters and Adam state,
and training gives the same parameters as the non-distributed optimizer."""

import pytest
import torch

from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.optimizer.toy_models import build, dp_collection, tiny_mlp, train_dp

STEPS = 3


def _same_training_with_sharded_state(dtype, bucket_size):
    pgc = dp_collection(2)
    sharded_model, plain_model = tiny_mlp(dtype), tiny_mlp(dtype)
    sharded_ddp, sharded = build(sharded_model, pgc, True, bucket_size, clip_grad=0.05, bf16=dtype == torch.bfloat16)
    plain_ddp, plain = build(plain_model, pgc, False, bucket_size, clip_grad=0.05, bf16=dtype == torch.bfloat16)
    assert isinstance(sharded, DistributedOptimizer) and type(plain) is MegatronOptimizer
    sharded_results = train_dp(sharded_ddp, sharded, pgc, STEPS)
    plain_results = train_dp(plain_ddp, plain, pgc, STEPS)
    assert [n for _, n, _ in sharded_results] == pytest.approx([n for _, n, _ in plain_results], rel=1e-5)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}  # {}: bf16 defaults
    for name, param in sharded_model.named_parameters():
        torch.testing.assert_close(param, plain_model.get_parameter(name), **tolerance, msg=name)
    return sharded.state_numel(), plain.state_numel()


@pytest.mark.parametrize(
    "dtype, bucket_size, sharded_sizes",
    [
        # one bucket of 67 elements padded to 80 (2 replicas x SHARD_ALIGNMENT 8 x 5): replica 0
        # owns 40, replica 1 owns 27 (+13 pad)
        (
            torch.float32,
            None,
            [
                {"master_params": 0, "exp_avg": 40, "exp_avg_sq": 40},
                {"master_params": 0, "exp_avg": 27, "exp_avg_sq": 27},
            ],
        ),
        # buckets [bias2 + weight2 = 27 -> 32] [bias1 + weight1 = 40 -> 48]: 16 + 24 and 11 + 16
        (
            torch.bfloat16,
            20,
            [
                {"master_params": 40, "exp_avg": 40, "exp_avg_sq": 40},
                {"master_params": 27, "exp_avg": 27, "exp_avg_sq": 27},
            ],
        ),
    ],
    ids=["fp32-one-bucket", "bf16-two-buckets"],
)
def test_sharded_state_and_same_params_as_plain_optimizer(dtype, bucket_size, sharded_sizes):
    results = run_distributed(_same_training_with_sharded_state, 2, dtype, bucket_size)
    assert [sharded for sharded, _ in results] == sharded_sizes
    full = 67 if dtype == torch.bfloat16 else 0
    assert [plain for _, plain in results] == [{"master_params": full, "exp_avg": 67, "exp_avg_sq": 67}] * 2
