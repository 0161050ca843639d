"""benchmarks/handoff_transfer.py runs between two processes, prints both rates and their ratio
and writes them as JSON; its pulls move one descriptor per layer plane and block run."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.unit_tests.inference.engines.test_offline_example import ROOT

SMALL = ["--layers", "2", "--blocks", "8", "--block-size", "4", "--kv-heads", "2", "--head-dim", "8"]


# The fragmented destination is blocks 1, 3, 5, 7, 8, 9, 10, 11 for source blocks 0..7: runs
# (0 -> 1), (1 -> 3), (2 -> 5), (3..7 -> 7..11), 4 per layer plane.
@pytest.mark.parametrize("extra, runs", [([], 2 * 2 * 1), (["--fragmented"], 2 * 2 * 4)])
def test_transfer_benchmark_prints_our_rate_against_raw_nixl(tmp_path, extra, runs):
    out = tmp_path / "handoff.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "handoff_transfer.py"), *SMALL, "--trials", "2"]
        + ["--device", "cpu", "--json", str(out), *extra],
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
    result = json.loads(out.read_text())
    assert result["bytes"] == 8 * 2 * 2 * 4 * 2 * 8 * 4 and result["descriptors"] == runs
    assert len(result["seconds"]["ours"]) == len(result["seconds"]["raw"]) == 2
    assert result["ratio"] == pytest.approx(result["median_seconds"]["raw"] / result["median_seconds"]["ours"])
