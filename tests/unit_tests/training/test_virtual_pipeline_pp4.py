"""GPT training on four ranks with virtual stages (PP4 x V2) through the real loop reproduces
the single-process loss curve."""

import pytest

from tests.unit_tests.training.test_virtual_pipeline_pp2 import _curve


def test_gpt_pp4_vp2_reproduces_the_single_process_curve(tmp_path):
    flags = ["--num-layers", "8", "--train-iters", "4"]
    reference = _curve("gpt", flags, 1, tmp_path / "pp1.jsonl")
    layout = ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2"]
    assert _curve("gpt", flags + layout, 4, tmp_path / "vpp.jsonl") == pytest.approx(reference, rel=1e-5)
