"""Pytest plugin that tools/run_test_bucket.py loads in every torchrun rank.

Each rank writes what happened to ``$MEGATRON_BUCKET_REPORT_DIR/rank<R>.json`` (pytest's exit
status and the node ids that passed, failed, errored or skipped), then waits, bounded, until
every rank has written its report: torchrun stops the other ranks as soon as one exits with an
error, which would lose a slower rank's results.
"""

from __future__ import annotations

import json
import os
import time

import pytest

REPORT_DIR_ENV = "MEGATRON_BUCKET_REPORT_DIR"
PEER_WAIT_S = 300.0

_outcomes: dict[str, list] = {"passed": [], "failed": [], "errors": [], "skipped": []}


def report_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0] if crash.message else ""
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def pytest_runtest_logreport(report):
    if report.skipped:
        _outcomes["skipped"].append(report.nodeid)
    elif report.failed:
        kind = "failed" if report.when == "call" else "errors"
        _outcomes[kind].append([report.nodeid, _message(report)])
    elif report.when == "call":
        _outcomes["passed"].append(report.nodeid)


def pytest_collectreport(report):
    if report.failed:
        _outcomes["errors"].append([report.nodeid, _message(report)])


@pytest.hookimpl(trylast=True)  # after the suite's own sessionfinish, which may fail a bad skip
def pytest_sessionfinish(session, exitstatus):
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory:
        return
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    report = dict(rank=rank, exitstatus=int(session.exitstatus), **_outcomes)
    partial = report_path(directory, rank) + ".partial"
    with open(partial, "w") as f:
        json.dump(report, f)
    os.replace(partial, report_path(directory, rank))
    deadline = time.monotonic() + PEER_WAIT_S
    while time.monotonic() < deadline and not all(
        os.path.exists(report_path(directory, peer)) for peer in range(world_size)
    ):
        time.sleep(0.1)
