"""Colocated MIMO layouts give the loss and gradients of a single-process run of the same weights.

The single process reads the same samples in micro-batches of the same per-rank size, so
the per-micro-batch mean losses are the same numbers (only their distribution differs).
"""

import functools

import pytest
import torch

from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.models.mimo.tiny import grads_after_one_batch


@functools.cache
def reference(micro_batch_size, num_microbatches):
    ((loss, grads),) = run_distributed(grads_after_one_batch, 1, {}, {}, num_microbatches, micro_batch_size)
    return loss, grads


@pytest.mark.parametrize(
    "world, language, encoder, micro_batch_size, num_microbatches, reference_microbatches",
    [
        (2, {"tp": 2}, {"tp": 1}, 2, 2, 2),
        (2, {"tp": 1}, {"tp": 2}, 1, 2, 4),
        (4, {"tp": 2, "gtp": 2}, {"tp": 2}, 1, 2, 4),
    ],
    ids=["lm_tp2_encoder_dp2", "lm_dp2_encoder_tp2", "lm_tp2xgtp2_encoder_tp2xdp2"],
)
def test_colocated_forward_backward_matches_single_process(
    world, language, encoder, micro_batch_size, num_microbatches, reference_microbatches
):
    ref_loss, ref_grads = reference(micro_batch_size, reference_microbatches)
    results = run_distributed(grads_after_one_batch, world, language, encoder, num_microbatches, micro_batch_size)
    for loss, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert sorted(grads) == sorted(ref_grads)
        for key, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[key], rtol=1e-4, atol=1e-6, msg=key)
