"""The Triton vocab-parallel cross-entropy on 2 TP ranks (gloo on CPU, NCCL on 2 GPUs): the
max / sum-exp / target-logit reductions over the group give torch's cross-entropy over the
whole vocabulary, fp32 and bf16 logits (the checks of test_cross_entropy.py)."""

import pytest
import torch

from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.fusions.test_cross_entropy import check_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_cross_entropy_matches_torch_on_two_ranks(dtype):
    assert run_distributed(check_cross_entropy, 2, dtype) == [True, True]
