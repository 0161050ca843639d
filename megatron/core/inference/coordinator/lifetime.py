"""Child processes that end with their parent.

Serving children (engine replica ranks, the workers of the examples) must never outlive the
process that started them: an orphan would hold its device, its port and a CPU core with
nobody left to answer. :func:`die_with_parent` arranges it from inside the child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None = None, signum: int = signal.SIGKILL) -> None:
    """Have this process receive ``signum`` as soon as its parent exits.

    Linux: ``prctl(PR_SET_PDEATHSIG)`` (sent when the parent *thread* that started this process
    exits, so start children from a thread that lives as long as the parent). Elsewhere, or
    when prctl fails, a daemon thread checks the parent every second.

    Args:
        parent_pid: the parent this process was started by; when it is already gone (this
            process was handed to another parent before the call), ``signum`` comes at once.
        signum: the signal to receive (SIGKILL: nothing of an orphan is worth saving).
    """
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid, signum), name="watch-parent", daemon=True).start()
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def _watch_parent(parent_pid: int, signum: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signum)
