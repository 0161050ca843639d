#!/usr/bin/env python3
"""Compare bf16 GPU training logs (JSONL from tools/gpu_checks.sh) with the CPU fp32 goldens.

    python tools/compare_to_goldens.py OUT_DIR [--rtol 0.03]

For each OUT_DIR/<family>_<layout>.jsonl it prints the max relative loss difference against
the golden curve of that family's functional case, the mean tokens/s and TFLOP/s.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_CASE = {"gpt": "gpt_tp2_pp2", "hybrid": "hybrid_tp2_gtp2"}


def summarize(path: str, golden: list[float]) -> dict:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r for r in records if r.get("type") == "train"]
    losses = [r["lm loss"] for r in train]
    steady = train[1:] or train or [{"tokens_per_s": 0.0, "tflops": 0.0}]  # iteration 1 includes start-up work
    return {
        "losses": losses,
        "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, golden, strict=True))
        if losses
        else float("inf"),
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "tflops": sum(r["tflops"] for r in steady) / len(steady),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--rtol", type=float, default=0.03)
    args = parser.parse_args(argv)
    failed = False
    for path in sorted(glob.glob(os.path.join(args.out_dir, "*.jsonl"))):
        name = os.path.basename(path)[:-6]
        family = name.split("_")[0]
        with open(os.path.join(ROOT, "tests", "functional_tests", "cases", f"{GOLDEN_CASE[family]}.json")) as f:
            golden = json.load(f)["golden_lm_loss"]
        s = summarize(path, golden)
        ok = len(s["losses"]) == len(golden) and s["max_rel_diff"] <= args.rtol
        failed |= not ok
        print(
            f"{name:14s} {'ok  ' if ok else 'FAIL'} max rel diff vs CPU fp32 golden {s['max_rel_diff']:.4f}"
            f" | tokens/s {s['tokens_per_s']:.0f} | TFLOP/s {s['tflops']:.3f}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
