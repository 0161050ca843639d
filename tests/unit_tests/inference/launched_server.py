"""A serving command run as a subprocess: its output read by a thread, its ``Serving on URL``
line awaited, and it and every process it started stopped by their ids."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time

STARTUP_TIMEOUT_S = 90


def descendants(pid: int) -> list[int]:
    """Every live process that ``pid`` started, directly or not (torchrun gives its workers
    sessions of their own, so a process group would not hold them)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(process: subprocess.Popen) -> None:
    """Kill a command and every process it started, by their ids."""
    for pid in [process.pid, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(10)


class LaunchedServer:
    """A started serving command (stdout and stderr merged into one text pipe)."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = STARTUP_TIMEOUT_S) -> re.Match:
        """The match of the next output line that matches ``pattern`` in full (lines before it are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            match = re.fullmatch(pattern, line.rstrip("\n"))
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.output)}")

    def wait_for_url(self) -> str:
        return self.wait_for(r"Serving on (http://127\.0\.0\.1:\d+)").group(1)

    def stop(self, signum: int, timeout_s: float = 30) -> int:
        """Send ``signum`` to the command; its exit code once it and its workers are gone."""
        workers = descendants(self.process.pid)
        self.process.send_signal(signum)
        code = self.process.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while any(map(alive, workers)):
            assert time.monotonic() < deadline, f"workers outlived the launcher:\n{''.join(self.output)}"
            time.sleep(0.1)
        return code


@contextlib.contextmanager
def serving(process: subprocess.Popen):
    """``(server, url)`` once ``process`` prints its URL; everything it started is killed after."""
    server = LaunchedServer(process)
    try:
        yield server, server.wait_for_url()
    finally:
        kill_tree(process)
