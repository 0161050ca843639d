"""Checkpoint directory layout: ``<root>/iter_XXXXXXX/`` per iteration and the ``latest``
tracker file ``<root>/latest_checkpointed_iteration.txt`` (Megatron's name).

A checkpoint directory is complete or absent: it is written under ``<dir>.incomplete`` and
renamed into place only once every file (the shards, the files published with them such as
``model_config.json`` and the tokenizer's, and last the metadata) is on disk; the tracker is
replaced atomically afterwards. A save killed at any point leaves the previous checkpoint and
tracker as they were; one killed between the rename and the tracker leaves a complete
directory the tracker does not name yet (see ``recovery``).

The named points of a save, in order, are :data:`SAVE_PHASES`; :func:`set_phase_hook` lets a
test run code (e.g. kill the process) when a rank reaches one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from megatron.core.dist_checkpointing.errors import CheckpointingError, CorruptCheckpointError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
STAGING_SUFFIX = ".incomplete"


SAVE_PHASES = (
    "staging_prepared",  # the coordinator created the empty staging directory
    "item_written",  # a rank appended one item to its shard file (not yet fsynced)
    "shards_written",  # a rank's shard file is complete and fsynced
    "metadata_written",  # the coordinator wrote every other file and metadata.json into staging
    "published",  # the coordinator renamed staging into place; the tracker has not moved
    "tracker_written",  # the tracker names the new iteration
)
_phase_hook: Callable[[str, str], None] | None = None


def set_phase_hook(hook: Callable[[str, str], None] | None) -> None:
    """Call ``hook(phase, path)`` whenever this process reaches a phase of :data:`SAVE_PHASES`
    (``path``: the directory being written); None removes it. A test seam for fault injection."""
    global _phase_hook
    _phase_hook = hook


def reached(phase: str, path: str) -> None:
    """Mark that this process reached ``phase`` of a save of ``path``."""
    if phase not in SAVE_PHASES:
        raise ValueError(f"unknown save phase {phase!r}; phases: {SAVE_PHASES}")
    if _phase_hook is not None:
        _phase_hook(phase, path)


def iteration_dir(root: str, iteration: int) -> str:
    """``<root>/iter_XXXXXXX`` (iteration zero-padded to 7 digits)."""
    if not isinstance(iteration, int) or iteration < 0:
        raise CheckpointingError(f"iteration must be an integer >= 0, got {iteration!r}")
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(checkpoint_dir: str) -> str:
    return os.path.normpath(checkpoint_dir) + STAGING_SUFFIX


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: str, data: bytes) -> None:
    """Write ``path`` through a temporary file, fsync, and rename over the old one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_latest_iteration(root: str) -> int | None:
    """The iteration named by the tracker in ``root``; None when there is no tracker.
    CorruptCheckpointError when the tracker does not hold an iteration number."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    text = data.strip()
    if not text.isdigit() or not text.isascii():
        raise CorruptCheckpointError(
            f"{path} must hold an iteration number (decimal digits), found {data[:40]!r} ({len(data)} bytes)"
        )
    return int(text)


def write_latest_iteration(root: str, iteration: int) -> None:
    """Point the tracker at ``iteration`` (atomically); its directory must be published."""
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointingError(
            f"cannot mark iteration {iteration} as latest: {iteration_dir(root, iteration)} does not exist"
        )
    write_file_atomically(os.path.join(root, TRACKER_FILENAME), f"{iteration}\n".encode())
    reached("tracker_written", iteration_dir(root, iteration))


def prepare_staging(checkpoint_dir: str) -> str:
    """Create an empty staging directory for ``checkpoint_dir`` (dropping a stale one left by a
    killed save) and return it. A published checkpoint is never overwritten."""
    if os.path.exists(checkpoint_dir):
        raise CheckpointingError(
            f"{checkpoint_dir} already exists; a published checkpoint is never overwritten: remove it or save "
            "under another name"
        )
    staging = staging_dir(checkpoint_dir)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    reached("staging_prepared", staging)
    return staging


def publish(
    staging: str, checkpoint_dir: str, files: dict[str, bytes], metadata_filename: str, metadata: bytes
) -> None:
    """Write ``files`` (paths relative to the checkpoint) and then the metadata into the staging
    directory, and rename it to ``checkpoint_dir``: all of them appear at once. (Inside staging
    nothing needs to be atomic: every file is fsynced, then the directories, then the rename.)"""
    directories = {staging}
    for relative_path, data in [*files.items(), (metadata_filename, metadata)]:
        path = os.path.join(staging, relative_path)
        directories.add(os.path.dirname(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    for directory in sorted(directories, reverse=True):  # subdirectories before staging itself
        _fsync_dir(directory)
    reached("metadata_written", staging)
    os.rename(staging, checkpoint_dir)
    _fsync_dir(os.path.dirname(os.path.abspath(checkpoint_dir)))
    reached("published", checkpoint_dir)
