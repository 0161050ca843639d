"""Serving children die with their parent (real processes, SIGKILL): a process that called
``die_with_parent`` ends when its parent is killed, and at once when its parent was already
gone; the prefill and decode engine processes of examples/inference/disaggregated.py end when
the example is killed, instead of polling a dead channel forever as orphans."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.readme import ROOT
from tests.unit_tests.inference.engines.test_offline_example import FLAGS
from tests.unit_tests.inference.launched_server import alive, descendants

DEADLINE_S = 300.0  # liveness bound: how long processes may take to start or to end on a busy machine


def _python(code: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, **popen)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _kill_and_expect_gone(parent: subprocess.Popen, children: list[int]) -> None:
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        _wait_for(lambda: not any(map(alive, children)), f"the children {children} to end with their parent")
    finally:  # no orphan outlives a failing test either
        for pid in filter(alive, children):
            os.kill(pid, signal.SIGKILL)


def test_a_child_that_called_die_with_parent_ends_when_its_parent_is_killed():
    parent = _python(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", '''
        from megatron.core.inference.coordinator.lifetime import die_with_parent
        die_with_parent()
        print("armed", flush=True)
        import time; time.sleep(600)
        '''], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "armed\\n"
        print(child.pid, flush=True)
        time.sleep(600)
        """,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        _kill_and_expect_gone(parent, [child])
    finally:
        parent.kill()
        parent.wait(10)


def test_a_child_whose_parent_is_already_gone_ends_at_once():
    # The parent the child names is not its parent (any more): it was handed on before arming.
    child = _python(
        """
        import os
        from megatron.core.inference.coordinator.lifetime import die_with_parent
        die_with_parent(parent_pid=os.getppid() + 1)
        print("outlived its parent", flush=True)
        """,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = child.communicate(timeout=DEADLINE_S)
    assert child.returncode == -signal.SIGKILL and out == ""


def test_the_disaggregated_example_takes_its_engine_processes_with_it(tmp_path):
    ids_file = tmp_path / "prompts.jsonl"
    ids_file.write_text("".join(json.dumps(list(range(1, 9))) + "\n" for _ in range(4)))
    example = os.path.join(ROOT, "examples", "inference", "disaggregated.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, example, "--prompt-token-ids-file", str(ids_file), *FLAGS]
    output = tmp_path / "example.log"
    with open(output, "w") as log:
        parent = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:

        def engines() -> list[int]:  # the prefill and decode processes (spawned python processes)
            assert parent.poll() is None, f"the example ended first:\n{output.read_text()}"
            return [pid for pid in descendants(parent.pid) if "spawn_main" in _cmdline(pid)]

        _wait_for(lambda: len(engines()) == 2, "the prefill and decode processes to start")
        children = descendants(parent.pid)  # the engines and multiprocessing's resource tracker
        _kill_and_expect_gone(parent, children)
    finally:
        parent.kill()
        parent.wait(10)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
