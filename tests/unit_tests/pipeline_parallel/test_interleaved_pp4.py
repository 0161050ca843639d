"""The interleaved schedule on four ranks (PP4 x V2): the toy pipeline and a GPT model with
MTP and tied embeddings give the single-process losses and gradients."""

import pytest

from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.pipeline_parallel.interleaved_models import check_layout_matches_single_process, losses_and_grads
from tests.unit_tests.pipeline_parallel.interleaved_toy import pipelined
from tests.unit_tests.pipeline_parallel.test_interleaved_schedule import check_against_plain_loop


@pytest.mark.parametrize("num_microbatches", [4, 8])
def test_toy_pp4_vp2_matches_single_process(num_microbatches):
    results = run_distributed(pipelined, 4, 4, 2, 8, num_microbatches)
    check_against_plain_loop(results, 8, num_microbatches, 4)


def test_gpt_pp4_vp2_matches_single_process():
    reference = run_distributed(losses_and_grads, 1, "gpt", 1, None, 4)[0]
    check_layout_matches_single_process(reference, run_distributed(losses_and_grads, 4, "gpt", 4, 2, 4))
