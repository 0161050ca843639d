"""Checkpoint directory layout: ``<root>/iter_XXXXXXX/`` per iteration and the ``latest``
tracker file ``<root>/latest_checkpointed_iteration.txt`` (Megatron's name).

A checkpoint directory is complete or absent: it is written under ``<dir>.incomplete`` and
renamed into place only once every file and the metadata are on disk; the tracker is
replaced atomically afterwards. A save killed at any point leaves the previous checkpoint
and tracker as they were.
"""

from __future__ import annotations

import os
import shutil

from megatron.core.dist_checkpointing.errors import CheckpointingError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
STAGING_SUFFIX = ".incomplete"


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
    """The iteration named by the tracker in ``root``; None when there is no tracker."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointingError(f"{path} must hold an iteration number, found {text[:40]!r}")
    return int(text)


def write_latest_iteration(root: str, iteration: int) -> None:
    """Point the tracker at ``iteration`` (atomically); its directory must be published."""
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointingError(
            f"cannot mark iteration {iteration} as latest: {iteration_dir(root, iteration)} does not exist"
        )
    write_file_atomically(os.path.join(root, TRACKER_FILENAME), f"{iteration}\n".encode())


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
    return staging


def publish(staging: str, checkpoint_dir: str, metadata_filename: str, metadata_json: str) -> None:
    """Write the metadata into the staging directory, then rename it to ``checkpoint_dir``."""
    write_file_atomically(os.path.join(staging, metadata_filename), metadata_json.encode())
    _fsync_dir(staging)
    os.rename(staging, checkpoint_dir)
    _fsync_dir(os.path.dirname(os.path.abspath(checkpoint_dir)))
