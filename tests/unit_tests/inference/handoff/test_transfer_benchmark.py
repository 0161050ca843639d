"""benchmarks/handoff_transfer.py runs between two processes, prints both rates and their ratio
and writes them as JSON; its pulls move one descriptor per layer plane and block run, also when
pipelined in layer groups (each group its own pull) or described without prepared lists."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.unit_tests.inference.engines.test_offline_example import ROOT

SMALL = ["--layers", "2", "--blocks", "8", "--block-size", "4", "--kv-heads", "2", "--head-dim", "8"]


def test_transfer_benchmark_prints_our_rate_against_raw_nixl(tmp_path):
    runs = 2 * 2 * 1  # (K, V) x 2 layers x one run of 8 blocks
    out = tmp_path / "handoff.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "handoff_transfer.py"), *SMALL, "--trials", "2"]
        + ["--device", "cpu", "--json", str(out)],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # 8 blocks x (K, V) x 2 layers x 4 tokens x 2 heads x 8 dims x 4 bytes
    assert re.search(
        rf"0\.01 MB in {runs} runs .*median of 2 alternating trials\): handoff pull [\d.]+ GB/s, "
        r"raw NIXL [\d.]+ GB/s, ratio [\d.]+",
        done.stdout,
    ), done.stdout
    assert re.search(
        rf"pipelined in 2 layer groups \({runs} runs\): [\d.]+ GB/s, ratio [\d.]+, all posted after [\d.]+ ms, "
        r"first group landed after [\d.]+ ms of [\d.]+ ms; unprepared descriptor lists: [\d.]+ GB/s, ratio [\d.]+",
        done.stdout,
    ), done.stdout
    result = json.loads(out.read_text())
    assert result["bytes"] == 8 * 2 * 2 * 4 * 2 * 8 * 4 and result["descriptors"] == runs
    assert result["pipelined_descriptors"] == runs and result["layer_groups"] == 2
    assert all(len(result["seconds"][name]) == 2 for name in ("ours", "pipelined", "unprepared", "raw"))
    median = result["median_seconds"]
    assert result["ratio"] == pytest.approx(median["raw"] / median["ours"])
    assert result["pipelined_ratio"] == pytest.approx(median["raw"] / median["pipelined"])
    assert 0 < result["posted_seconds"] and 0 < result["first_group_seconds"]
