"""Every test file belongs to exactly one GPU bucket."""

import glob
import os
import re

from tools.run_test_bucket import bucket_files, load_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_test_file_is_in_exactly_one_bucket():
    buckets = load_buckets()
    owners: dict[str, list[str]] = {}
    for name, bucket in buckets.items():
        assert bucket["gpus"] in (1, 2, 4, 8), name
        for path in bucket_files(bucket, ROOT):
            owners.setdefault(path, []).append(name)
    test_files = [
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
    ]
    assert test_files
    for path in test_files:
        assert len(owners.get(path, [])) == 1, f"{path} is in buckets {owners.get(path, [])}; it needs exactly one"


PLANTED = """
import os

import torch
import torch.distributed as dist

from tests.unit_tests.dist_harness import run_distributed


def _sum_of_ranks():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise KeyError("planted failure")
    dist.barrier()


def _echo(path, values):
    return path, values


def test_a_rank_raising_fails_the_test_on_every_rank():
    run_distributed(_rank_one_raises, 2, timeout_s=2)


def test_the_next_test_meets_in_a_fresh_world():
    assert run_distributed(_sum_of_ranks, 2) == [(0, 3.0), (1, 3.0)]


def test_every_rank_gets_the_arguments_of_rank_zero(tmp_path):
    values = torch.randn(3)  # unseeded: differs between the ranks' processes
    results = run_distributed(_echo, 2, str(tmp_path), values)
    assert all(path == results[0][0] and torch.equal(v, results[0][1]) for path, v in results)
    if os.environ["RANK"] == "0":
        assert results[0][0] == str(tmp_path) and torch.equal(results[0][1], values)


def test_only_rank_one_fails():
    assert os.environ["RANK"] != "1", "planted failure on rank 1"


def test_skipped_elsewhere():
    run_distributed(_sum_of_ranks, 4)
"""


def test_the_runner_fails_naming_each_rank_and_test_that_failed(tmp_path, capfd):
    from tools.run_test_bucket import run_bucket

    planted = tmp_path / "test_planted.py"
    planted.write_text(PLANTED)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # gloo on any machine
    code = run_bucket("planted", [str(planted)], 2, 300, [], env=env, log_dir=str(tmp_path / "logs"))
    out = capfd.readouterr().out
    assert code != 0
    assert f"bucket planted FAILED (torchrun exit status 1); the other ranks' output is under {tmp_path}" in out
    (rank_one_log,) = glob.glob(str(tmp_path / "logs" / "**" / "1" / "stdout.log"), recursive=True)
    assert "planted failure on rank 1" in open(rank_one_log).read()
    assert "rank 0: 3 passed, 1 failed, 0 errors, 1 skipped (pytest exit status 1)" in out
    assert "rank 1: 2 passed, 2 failed, 0 errors, 1 skipped (pytest exit status 1)" in out
    failures = [line.split(" - ")[0] for line in out.splitlines() if line.startswith("rank ") and " FAILED " in line]
    # Test ids are relative to the inner run's rootdir, which depends on where the checkout lives.
    failures = [re.sub(r"FAILED \S*/test_planted\.py", "FAILED test_planted.py", line) for line in failures]
    assert failures == [
        "rank 0: FAILED test_planted.py::test_a_rank_raising_fails_the_test_on_every_rank",
        "rank 1: FAILED test_planted.py::test_a_rank_raising_fails_the_test_on_every_rank",
        "rank 1: FAILED test_planted.py::test_only_rank_one_fails",
    ]
    assert "rank 1: KeyError: 'planted failure'" in out  # every rank names the rank that raised
