"""benchmarks/handoff_transfer.py runs between two processes and prints both rates and their ratio."""

import os
import re
import subprocess
import sys

from tests.unit_tests.inference.engines.test_offline_example import ROOT


def test_transfer_benchmark_prints_our_rate_against_raw_nixl():
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "handoff_transfer.py"),
            "--layers",
            "2",
            "--blocks",
            "8",
            "--block-size",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--iters",
            "2",
            "--device",
            "cpu",
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # 8 blocks x (K, V) x 2 layers x 4 tokens x 2 heads x 8 dims x 4 bytes
    assert re.search(
        r"0\.01 MB in 32 runs .*handoff pull [\d.]+ GB/s, raw NIXL [\d.]+ GB/s, ratio [\d.]+", done.stdout
    ), done.stdout
