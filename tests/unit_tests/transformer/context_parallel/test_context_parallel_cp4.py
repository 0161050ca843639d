"""CP4 on four real gloo processes: ring and all-gather attention equal SDPA on the whole
sequence; GPT and hybrid (``M*M-``) losses and gathered gradients equal CP1's; each rank's
attention input is a quarter of the sequence and every rank computes the same chunk pairs."""

import pytest
import torch

from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.transformer.context_parallel import cp_cases

CP = 4


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_attention_over_the_sharded_sequence_equals_sdpa(comm_type):
    for error, tolerance in run_distributed(cp_cases.attention_against_sdpa, CP, comm_type, "torch"):
        assert error < tolerance


@pytest.mark.parametrize("family", ["gpt", "hybrid"])
def test_loss_and_gathered_gradients_equal_cp1(family):
    ((loss_1, grads_1),) = run_distributed(cp_cases.loss_and_gradients, 1, family, 1)
    loss_c, grads_c = run_distributed(cp_cases.loss_and_gradients, CP, family, CP)[0]
    assert loss_c == pytest.approx(loss_1, rel=1e-6)
    for name, grad in grads_1.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_each_rank_attends_a_quarter_of_the_sequence_with_equal_work():
    results = run_distributed(cp_cases.attention_work_per_rank, CP)
    assert all(lengths == [cp_cases.SEQ // CP] * 2 for lengths, _ in results)
    works = [work for _, work in results]
    assert works == [2 * CP] * CP  # chunk pairs: 2 per ring step on every rank
