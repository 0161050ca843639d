"""Must-show of issue 22 on CPU: a tiny dropless MoE GPT trains to the EP1 loss curve under
EP2, EP4, EP2xTP2 (experts over expert-TP = TP 2) and EP2xPP2."""

import pytest

from tests.unit_tests.training.test_layout_equivalence import _curve

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--train-iters", "4"]


@pytest.fixture(scope="module")
def ep1_curve(tmp_path_factory):
    return _curve("gpt", MOE, 1, tmp_path_factory.mktemp("ep1"))


@pytest.mark.parametrize(
    "world, flags",
    [
        (2, ["--expert-model-parallel-size", "2"]),
        (4, ["--expert-model-parallel-size", "4"]),
        (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
        (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ],
    ids=["EP2", "EP4", "EP2xTP2", "EP2xPP2"],
)
def test_expert_parallel_loss_curve_equals_ep1(ep1_curve, tmp_path, world, flags):
    curve = _curve("gpt", MOE + flags, world, tmp_path)
    assert len(curve) == len(ep1_curve) == 4
    assert all(abs(a - b) <= 1e-5 for a, b in zip(curve, ep1_curve, strict=True)), (curve, ep1_curve)
    assert curve[-1] < curve[0]
