#!/usr/bin/env python3
"""Run one multi-GPU test bucket from tests/test_buckets.toml under torchrun.

    python tools/run_test_bucket.py gpu2 [--only GLOB] [-- extra pytest args]

Every rank runs pytest over the bucket's files; the distributed test harness sees the torchrun
world and runs each test whose world size matches in place, on NCCL when CUDA is present and on
gloo (CPU) otherwise. Rank 0's output is shown live; the other ranks' is kept in a log directory.
At the end each rank's outcome is summarised, and the command fails (nonzero) when any test
failed or errored on any rank, naming the rank, or when a rank ended without a report.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKETS_FILE = os.path.join(ROOT, "tests", "test_buckets.toml")
REPORT_PLUGIN = "tests.bucket_report"
REPORT_DIR_ENV = "MEGATRON_BUCKET_REPORT_DIR"  # read by the plugin above


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


def describe_devices(nproc: int) -> str | None:
    """How the ranks will communicate; None (after printing why) when CUDA cannot hold them."""
    import torch

    if not torch.cuda.is_available():
        return f"CUDA is absent: {nproc} rank{'s' * (nproc != 1)} on CPU with gloo"
    found = torch.cuda.device_count()
    if found < nproc:
        print(f"this bucket needs {nproc} GPUs, this machine has {found}", file=sys.stderr)
        return None
    return f"{nproc} rank{'s' * (nproc != 1)} on {nproc} of {found} GPUs with NCCL"


def summarize(report_dir: str, nproc: int) -> list[str]:
    """Print each rank's outcome; return one line per problem (empty when every rank passed)."""
    problems = []
    for rank in range(nproc):
        path = os.path.join(report_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            problems.append(f"rank {rank}: ended without a report (crashed, killed or timed out)")
            continue
        with open(path) as f:
            report = json.load(f)
        print(
            f"rank {rank}: {len(report['passed'])} passed, {len(report['failed'])} failed, "
            f"{len(report['errors'])} errors, {len(report['skipped'])} skipped (pytest exit status "
            f"{report['exitstatus']})"
        )
        for kind in ("failed", "errors"):
            for nodeid, message in report[kind]:
                problems.append(f"rank {rank}: {'FAILED' if kind == 'failed' else 'ERROR'} {nodeid} - {message}")
        if report["exitstatus"] != 0 and not report["failed"] and not report["errors"]:
            problems.append(f"rank {rank}: pytest exited with status {report['exitstatus']}")
    return problems


def run_bucket(
    name: str,
    files: list[str],
    nproc: int,
    timeout_s: float,
    pytest_args=(),
    env: dict | None = None,
    log_dir: str | None = None,
) -> int:
    """Run ``files`` under torchrun on ``nproc`` ranks; print a per-rank summary; return the exit
    code. The output of ranks other than 0 goes under ``log_dir`` (a temporary directory, kept on
    failure)."""
    env = dict(os.environ if env is None else env)
    keep_logs = log_dir is not None
    log_dir = log_dir or tempfile.mkdtemp(prefix=f"bucket_{name}_logs_")
    with tempfile.TemporaryDirectory(prefix=f"bucket_{name}_") as report_dir:
        env[REPORT_DIR_ENV] = report_dir
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--log-dir={log_dir}",
            *([f"--redirects={','.join(f'{rank}:3' for rank in range(1, nproc))}"] if nproc > 1 else []),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            REPORT_PLUGIN,
            *files,
            *pytest_args,
        ]
        print(" ".join(cmd), flush=True)
        try:
            returncode = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"bucket {name} exceeded its {timeout_s:g}s limit", file=sys.stderr)
            returncode = 124
        print(f"\n=== bucket {name}: per-rank results")
        problems = summarize(report_dir, nproc)
    for line in problems:
        print(line)
    if problems or returncode != 0:
        print(f"bucket {name} FAILED (torchrun exit status {returncode}); the other ranks' output is under {log_dir}")
        return returncode or 1
    if not keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    print(f"bucket {name} passed on every rank", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s BUCKET [--only GLOB] [-- PYTEST_ARGS...]",
    )
    parser.add_argument("bucket")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="GLOB",
        help="run only the bucket's files matching GLOB (repeatable)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
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
    devices = describe_devices(bucket["gpus"])
    if devices is None:
        return 2
    print(f"bucket {args.bucket}: {len(files)} files; {devices}", flush=True)
    return run_bucket(args.bucket, files, bucket["gpus"], bucket["timeout_s"], pytest_args)


if __name__ == "__main__":
    sys.exit(main())
