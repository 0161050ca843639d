#!/usr/bin/env python3
"""Run one multi-GPU test bucket from tests/test_buckets.toml under torchrun.

    python tools/run_test_bucket.py gpu2 [-- extra pytest args]

Each rank runs pytest over the bucket's files; the distributed test harness sees the
torchrun world and runs every test whose world size matches on NCCL.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKETS_FILE = os.path.join(ROOT, "tests", "test_buckets.toml")


def load_buckets(path: str = BUCKETS_FILE) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)["buckets"]


def bucket_files(bucket: dict, root: str = ROOT) -> list[str]:
    def expand(patterns):
        return {
            os.path.relpath(p, root)
            for pattern in patterns
            for p in glob.glob(os.path.join(root, pattern), recursive=True)
        }

    return sorted(expand(bucket["globs"]) - expand(bucket.get("exclude", [])))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bucket")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="GLOB",
        help="run only the bucket's files matching GLOB (repeatable)",
    )
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    buckets = load_buckets()
    if args.bucket not in buckets:
        parser.error(f"unknown bucket {args.bucket!r}; known: {', '.join(buckets)}")
    bucket = buckets[args.bucket]
    files = bucket_files(bucket)
    if args.only:
        files = [f for f in files if any(fnmatch.fnmatch(f, pattern) for pattern in args.only)]
    if not files:
        print(f"bucket {args.bucket} has no test files", file=sys.stderr)
        return 1
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={bucket['gpus']}",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *files,
        *args.pytest_args,
    ]
    print(" ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, timeout=bucket["timeout_s"]).returncode
    except subprocess.TimeoutExpired:
        print(f"bucket {args.bucket} exceeded its {bucket['timeout_s']}s limit", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
