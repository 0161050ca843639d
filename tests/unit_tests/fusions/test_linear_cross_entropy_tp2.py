"""The fused output layer + cross-entropy on 2 TP ranks (gloo on CPU, NCCL on 2 GPUs): the
max / sum-exp / target-logit reductions over the group per chunk give the one-rank results,
torch's cross-entropy over the whole vocabulary (the checks of test_linear_cross_entropy.py).
On CPU the per-chunk math runs on torch ops (the Triton kernels' own two-rank reductions are
test_cross_entropy_tp2.py's); on 2 GPUs on the kernels too."""

import pytest
import torch

from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.fusions.test_linear_cross_entropy import check_linear_cross_entropy

CASES = [
    pytest.param(torch.bfloat16, None, "torch", id="bf16-torch"),
    pytest.param(torch.bfloat16, None, "triton", id="bf16-triton", marks=pytest.mark.gpu(2)),
    pytest.param(torch.bfloat16, torch.float32, "triton", id="bf16-fp32logits-triton", marks=pytest.mark.gpu(2)),
]


@pytest.mark.parametrize(("dtype", "logit_dtype", "backend"), CASES)
def test_linear_cross_entropy_on_two_ranks_matches_one(dtype, logit_dtype, backend):
    assert run_distributed(check_linear_cross_entropy, 2, dtype, logit_dtype, backend) == [True, True]
