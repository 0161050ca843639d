"""``benchmarks/moe_gpu.py --tiny`` runs on CPU as written: it trains through the Trainer with
falling loss, counts the parameters a token meets by hand's count, and times the GEMMs."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


def test_tiny_run_trains_counts_active_parameters_and_times_the_gemms(tmp_path):
    out = tmp_path / "moe.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(REPO / "benchmarks/moe_gpu.py"), "--tiny", "--output-json", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    train = report["train"]
    assert train["steps"] == 10 and train["loss_fell"] and train["tflops"] > 0
    assert [entry["iteration"] for entry in train["log"]] == [5, 10]
    assert all(entry["load_balancing_loss"] > 0 for entry in train["log"])
    # By hand, per layer: qkv 64 x (64 + 2 x 32), proj 64 x 64, two norms, router 4 x 64, and
    # experts of 64 x 128 + 64 x 64 each (4 in all, 2 met); final norm; embedding and output 128 x 64.
    dense_per_layer = 8192 + 4096 + 128 + 256
    assert train["parameters"] == {
        "total": 2 * (dense_per_layer + 4 * 12288) + 64 + 2 * 8192,
        "active": 2 * (dense_per_layer + 2 * 12288) + 64 + 2 * 8192,
        "active_without_embeddings": 2 * (dense_per_layer + 2 * 12288) + 64 + 8192,
    }
    gemm = report["gemm"]
    assert gemm["grouped_path"] == "loop" and gemm["rows"] == 32 * 2 * 2
    for name in ("fc1", "fc2"):
        assert set(gemm[name]["tflops"]) == {"grouped", "dense", "loop"}
        assert all(value > 0 for value in gemm[name]["tflops"].values())
    assert "load_balancing_loss:" in done.stdout and "grouped/dense" in done.stdout
