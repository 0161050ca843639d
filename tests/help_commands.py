"""Run several ``python FILE --help`` / ``python -m MODULE --help`` commands in one interpreter.

Each command's help costs a Python start and the imports of torch, transformers and the package
(seconds on 2 cores) before argparse prints a line; run one after another in one subprocess,
they pay for those imports once. Each still runs as ``__main__`` with its own ``sys.argv``, its
output and exit status kept apart: ``{command: {"returncode", "stdout", "stderr"}}``.

    python -m tests.help_commands OUT.json COMMAND...
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import shlex
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path


def _run_one(command: str) -> dict:
    words = shlex.split(command)
    if words[0] not in ("python", "python3") or len(words) < 2:
        raise ValueError(f"not a python command: {command!r}")
    stdout, stderr, returncode = io.StringIO(), io.StringIO(), 0
    saved_argv = sys.argv
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            if words[1] == "-m":
                sys.argv = [words[2], *words[3:]]
                runpy.run_module(words[2], run_name="__main__", alter_sys=True)
            else:
                sys.argv = words[1:]
                runpy.run_path(words[1], run_name="__main__")
        except SystemExit as stop:
            returncode = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # noqa: BLE001 - the traceback is the command's report
            traceback.print_exc()
            returncode = 1
        finally:
            sys.argv = saved_argv
    return {"returncode": returncode, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def run_help_commands(commands: list[str], cwd, env: dict, timeout_s: float = 300) -> dict[str, dict]:
    """Run ``commands`` (each ``python ... --help``) in one subprocess in ``cwd``; their results."""
    with tempfile.TemporaryDirectory(prefix="help_commands_") as tmp:
        report = Path(tmp) / "help.json"
        done = subprocess.run(
            [sys.executable, "-m", "tests.help_commands", str(report), *commands],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, f"the help runner failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return json.loads(report.read_text(encoding="utf-8"))


def main(argv: list[str]) -> int:
    report, commands = argv[0], argv[1:]
    results = {command: _run_one(command) for command in commands}
    with open(report, "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
