"""The CI subset of the functional cases reproduces its goldens, and the goldens themselves
are checked against an independent reference: a plain PyTorch loop (HuggingFace Llama +
torch.optim.AdamW) trained on the same weights and data."""

import pytest

from benchmarks.train_throughput import compare
from tests.functional_tests.run_functional import compare as compare_losses
from tests.functional_tests.run_functional import load_cases, run_case, training_losses
from tests.unit_tests.dist_harness import run_distributed

CASES = load_cases()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "ci" in c["subsets"]])
def test_ci_case_matches_goldens(name):
    case = CASES[name]
    records = run_case(name, case, [])
    losses = training_losses(records)
    assert compare_losses(name, losses, case["golden_lm_loss"], case["rtol"]) == []
    assert losses[-1] < losses[0] - 0.5  # it learns the built-in corpus
    assert any(r["type"] == "train" and "tokens_per_s" in r and "grad_norm" in r for r in records)


def _plain_loop_losses(flags, steps):
    result = compare(flags, steps)
    return result["plain_losses"], result["ours_losses"]


def test_gpt_goldens_match_a_plain_pytorch_loop():
    case = CASES["gpt_tp2_pp2"]
    flags = [f for f in case["flags"]]
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        i = flags.index(flag)
        del flags[i : i + 2]
    flags = flags + ["--distributed-backend", "gloo"]
    ((plain, ours),) = run_distributed(_plain_loop_losses, 1, flags, 3)
    assert plain == pytest.approx(case["golden_lm_loss"][:3], rel=1e-4)
    assert ours == pytest.approx(case["golden_lm_loss"][:3], rel=1e-4)


def test_cases_pin_the_defaults_their_goldens_rely_on():
    """Goldens must not move when a default does (Megatron's dropout, evaluation, logging and
    Mamba defaults are not what these small runs use): every case names those flags."""
    for name, case in CASES.items():
        needed = ["--hidden-dropout", "--attention-dropout", "--eval-iters", "--log-interval"]
        if case["entry_point"].endswith("pretrain_hybrid.py"):
            needed += ["--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-chunk-size"]
        if "--fp16" in case["flags"]:
            needed.append("--initial-loss-scale")
        assert [flag for flag in needed if flag not in case["flags"]] == [], name


@pytest.mark.parametrize("cp_case, twin", [("gpt_cp2_tp2", "gpt_tp2_pp2"), ("hybrid_cp2_gtp2", "hybrid_tp2_gtp2")])
def test_context_parallel_goldens_equal_their_twins_without_cp(cp_case, twin):
    """The same model and data at another layout: CP must not change the losses."""
    assert CASES[cp_case]["golden_lm_loss"] == pytest.approx(CASES[twin]["golden_lm_loss"], rel=1e-5)
