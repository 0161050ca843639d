#!/usr/bin/env python3
"""Run end-to-end training cases under torchrun and compare their losses with golden values.

    python tests/functional_tests/run_functional.py                  # every case
    python tests/functional_tests/run_functional.py --subset ci      # the short CPU subset
    python tests/functional_tests/run_functional.py --case gpt_tp2_pp2 --update-goldens
    python tests/functional_tests/run_functional.py --case gpt_tp2_pp2 --device cuda --bf16

A case is a JSON file in cases/: the entry point, the number of processes, the flags, the
subsets it belongs to, and the golden "lm loss" per iteration with a relative tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CASES_DIR = os.path.join(HERE, "cases")


def load_cases() -> dict[str, dict]:
    cases = {}
    for name in sorted(os.listdir(CASES_DIR)):
        if name.endswith(".json"):
            with open(os.path.join(CASES_DIR, name), encoding="utf-8") as f:
                cases[name[:-5]] = json.load(f)
    return cases


def run_case(
    name: str, case: dict, extra_flags: list[str], nproc: int | None = None, timeout_s: int = 900
) -> list[dict]:
    """Launch the case under torchrun; return its JSONL training records."""
    with tempfile.TemporaryDirectory(prefix=f"functional_{name}_") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc or case['nproc']}",
            os.path.join(ROOT, case["entry_point"]),
            *case["flags"],
            "--metrics-jsonl",
            metrics,
            *extra_flags,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"case {name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        with open(metrics, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def training_losses(records: list[dict]) -> list[float]:
    return [r["lm loss"] for r in records if r.get("type") == "train"]


def compare(name: str, losses: list[float], golden: list[float], rtol: float) -> list[str]:
    """Mismatches between a run's losses and the goldens, as readable lines."""
    if len(losses) != len(golden):
        return [f"{name}: {len(losses)} losses, golden has {len(golden)}"]
    return [
        f"{name}: iteration {i + 1}: loss {got:.6f} vs golden {want:.6f} "
        f"(rel diff {abs(got - want) / abs(want):.2e} > {rtol})"
        for i, (got, want) in enumerate(zip(losses, golden, strict=True))
        if abs(got - want) > rtol * abs(want)
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help="case name (repeatable); default: all")
    parser.add_argument("--subset", help="only cases listing this subset, e.g. ci")
    parser.add_argument("--update-goldens", action="store_true")
    parser.add_argument("--rtol", type=float, default=None, help="override each case's tolerance")
    parser.add_argument("--nproc", type=int, default=None, help="override the process count (e.g. GPUs)")
    parser.add_argument("extra", nargs="*", help="extra flags for every case, after --")
    args = parser.parse_args(argv)
    cases = load_cases()
    unknown = [c for c in args.case or [] if c not in cases]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(cases)}")
    selected = {
        n: c
        for n, c in cases.items()
        if (not args.case or n in args.case) and (not args.subset or args.subset in c.get("subsets", []))
    }
    failures = []
    for name, case in selected.items():
        losses = training_losses(run_case(name, case, args.extra, args.nproc))
        if args.update_goldens:
            case["golden_lm_loss"] = losses
            with open(os.path.join(CASES_DIR, f"{name}.json"), "w", encoding="utf-8") as f:
                json.dump(case, f, indent=2)
                f.write("\n")
            print(f"{name}: goldens updated ({len(losses)} values)")
            continue
        problems = compare(name, losses, case["golden_lm_loss"], args.rtol or case["rtol"])
        failures += problems
        print(f"{name}: {'FAIL' if problems else 'ok'}  losses {[f'{x:.4f}' for x in losses]}")
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
