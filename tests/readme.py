"""README.md's command lines, and how tests run them the way a user types them.

:func:`readme_commands` reads every command of the README's ```bash blocks (continuation
lines joined, comments dropped). Tests run one with :func:`run_command` / :func:`start_command`:
through ``bash -c`` exactly as written, except for the ``replacements`` a test must make
(a free port for ``8000``, a checkpoint of the test's for ``runs/quickstart``), with ``python``
and ``python3`` meaning this interpreter and the package's console scripts on ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONSOLE_SCRIPTS = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
_TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment (a ``#`` outside quotes that starts a word)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def readme_commands(path: Path = README) -> list[str]:
    """The command lines of the ```bash blocks of ``path``, in order."""
    commands, block, pending = [], False, ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        if raw.strip().startswith("```"):
            block = raw.strip() == "```bash" and not block
            continue
        if not block:
            continue
        line = _strip_comment(raw) if not pending else raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line = _strip_comment(pending + line.strip())
        pending = ""
        if line:
            commands.append(line)
    return commands


def readme_command(prefix: str) -> str:
    """The one README command that starts with ``prefix``."""
    found = [c for c in readme_commands() if c.startswith(prefix)]
    assert len(found) == 1, f"README.md has {len(found)} commands starting with {prefix!r}: {found}"
    return found[0]


def _scripts_dirs() -> list[str]:
    return list(dict.fromkeys([sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]))


def console_script(name: str) -> str:
    """Where the installed console script ``name`` is (installed by ``pip install -e .``)."""
    found = shutil.which(name, path=os.pathsep.join(_scripts_dirs())) or shutil.which(name)
    assert found, f"console script {name} is not installed for {sys.executable}: run pip install -e ."
    return found


_SHIMS: str | None = None


def _python_shims() -> str:
    """A directory whose ``python`` and ``python3`` run this interpreter (scripts, not links,
    so that a virtual environment stays itself)."""
    global _SHIMS
    if _SHIMS is None:
        _SHIMS = tempfile.mkdtemp(prefix="readme_python_")
        for name in ("python", "python3"):
            shim = os.path.join(_SHIMS, name)
            with open(shim, "w", encoding="utf-8") as f:
                f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            os.chmod(shim, 0o755)
    return _SHIMS


def subprocess_env(**extra: str) -> dict:
    """The environment a test's subprocess runs in: this one without torchrun's variables (the
    subprocess starts its own world), this checkout importable, single-threaded ranks."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC")}
    return env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | extra


def command_env(**extra: str) -> dict:
    """The environment README commands run in: :func:`subprocess_env` with the console scripts
    (and ``python``) on ``PATH`` and unbuffered output."""
    for name in CONSOLE_SCRIPTS:
        console_script(name)
    path = os.pathsep.join([_python_shims(), *_scripts_dirs(), os.environ.get("PATH", "")])
    return subprocess_env(PATH=path, PYTHONUNBUFFERED="1", **extra)


def needs_a_device_per_rank(num_ranks: int) -> None:
    """Launched commands run on CUDA when the machine has it (one GPU per rank), else on CPU:
    skip (the one accepted reason) on a machine with too few GPUs."""
    import pytest
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} GPUs (found {torch.cuda.device_count()})")


def _substituted(command: str, replacements: dict[str, str] | None) -> str:
    for old, new in (replacements or {}).items():
        assert old in command, f"{old!r} is not in the README command {command!r}"
        command = command.replace(old, new)
    return command


def run_command(
    command: str,
    cwd: Path | str,
    replacements: dict[str, str] | None = None,
    timeout_s: float = 300,
    env: dict | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``command`` (a README command line) through bash in ``cwd``; by default fail with
    its output unless it exits 0."""
    done = subprocess.run(
        ["bash", "-c", _substituted(command, replacements)],
        cwd=cwd,
        env=env or command_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if check:
        assert done.returncode == 0, (
            f"{command!r} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def start_command(
    command: str, cwd: Path | str, replacements: dict[str, str] | None = None, env: dict | None = None
) -> subprocess.Popen:
    """Start ``command`` through bash in ``cwd`` (``exec``: the process is the command), its
    stdout and stderr merged into one text pipe."""
    return subprocess.Popen(
        ["bash", "-c", "exec " + _substituted(command, replacements)],
        cwd=cwd,
        env=env or command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
