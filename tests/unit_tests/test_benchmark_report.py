"""The benchmarks' shared ending: rank 0 writes the JSON report, every rank leaves the world,
the exit code comes back."""

import json
import os

import torch.distributed as dist

from megatron.core.benchmark_report import busy_us, finish, write_report
from tests.unit_tests.dist_harness import run_distributed


def _finish_on_every_rank(directory):
    rank = dist.get_rank()
    write_report({"written_by": rank}, None)  # no path: nothing is written
    code = finish({"written_by": rank, "ratio": 0.5}, os.path.join(directory, "report.json"), exit_code=3)
    # finish meets every rank before leaving the world: rank 0's report is on disk for all of them
    with open(os.path.join(directory, "report.json"), encoding="utf-8") as f:
        return code, dist.is_initialized(), sorted(os.listdir(directory)), json.load(f)


def test_rank_zero_writes_the_report_and_every_rank_leaves_the_world(tmp_path):
    seen = (3, False, ["report.json"], {"written_by": 0, "ratio": 0.5})
    assert run_distributed(_finish_on_every_rank, 2, str(tmp_path)) == [seen, seen]


def test_without_a_world_the_report_is_written_and_the_code_returned(tmp_path):
    path = tmp_path / "report.json"
    assert finish({"keys": ["kept", "as", "given"]}, str(path)) == 0
    assert json.loads(path.read_text()) == {"keys": ["kept", "as", "given"]}


def test_busy_time_is_the_union_of_the_kernel_intervals():
    # Overlapping [0, 4) and [2, 5), one nested [3, 4), a gap, then [7, 9): 5 + 2 busy.
    assert busy_us([(7.0, 9.0), (0.0, 4.0), (3.0, 4.0), (2.0, 5.0)]) == 7.0
    assert busy_us([]) == 0.0
