"""Checkpoint iterations the tracker does not name yet, end-to-end verification, and the
retirement of old iterations (:func:`retire_iterations`).

A save killed after its directory was published but before the tracker moved leaves an
``iter_*`` newer than the tracker (so did older versions of this code when killed before they
wrote ``model_config.json`` after publishing). Such an iteration is never loaded unverified:
:func:`adopt_untracked` verifies it end to end (:func:`verify_checkpoint`) and moves the
tracker to it when it is complete; one that is not is left alone (a log line says so) and is
replaced when that iteration is saved again (:func:`settle_existing`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from megatron.core.dist_checkpointing.checksums import Checksum, new_hasher
from megatron.core.dist_checkpointing.core import iteration_dir, read_latest_iteration, write_latest_iteration
from megatron.core.dist_checkpointing.errors import CheckpointingError, CorruptCheckpointError
from megatron.core.dist_checkpointing.metadata import CheckpointMetadata, read_json, read_metadata
from megatron.core.dist_checkpointing.strategies.stream_io import StreamIO, hash_range
from megatron.core.dist_checkpointing.strategies.torch_dcp import verify_slices

logger = logging.getLogger(__name__)
_ITERATION_DIR = re.compile(r"iter_(\d{7,})")


def verify_files(checkpoint_dir: str, metadata: CheckpointMetadata, names) -> None:
    """Check that each file ``names`` lists (paths relative to the checkpoint, among those the
    metadata records) has its recorded length and checksum; CorruptCheckpointError naming the
    first file that is missing or differs."""
    with StreamIO() as stream_io:
        for name in sorted(names):
            stored = metadata.files[name]
            path = os.path.join(checkpoint_dir, name)
            if not os.path.isfile(path):
                raise CorruptCheckpointError(f"{path} is missing from the checkpoint")
            fd = os.open(path, os.O_RDONLY)
            try:
                hasher = new_hasher(stored.checksum.algorithm)
                length = hash_range(stream_io, fd, 0, max(stored.length, os.fstat(fd).st_size), hasher)
            finally:
                os.close(fd)
            actual = Checksum.of(hasher, stored.checksum.algorithm)
            if length != stored.length or actual != stored.checksum:
                raise CorruptCheckpointError(
                    f"{path} is damaged: {length} bytes with {actual}, the checkpoint recorded {stored.length} bytes "
                    f"with {stored.checksum}"
                )


def verify_checkpoint(checkpoint_dir: str, required_files: tuple[str, ...] = ()) -> CheckpointMetadata:
    """Check a published checkpoint end to end: its metadata parses, every stored item and every
    file the metadata lists has its recorded length and checksum, and ``required_files`` exist
    (JSON ones must parse). Returns the metadata; raises CheckpointingError (not a complete
    checkpoint) or CorruptCheckpointError (damaged), naming the file at fault."""
    metadata = read_metadata(checkpoint_dir)
    verify_slices(checkpoint_dir, metadata.slices())
    verify_files(checkpoint_dir, metadata, metadata.files)
    for name in required_files:
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path):
            raise CheckpointingError(f"{checkpoint_dir} is not a complete checkpoint: {name} is missing")
        if name.endswith(".json"):
            read_json(path)
    return metadata


def _iterations(root: str) -> list[int]:
    """Iterations of ``root`` that have an ``iter_*`` directory, ascending."""
    if not os.path.isdir(root):
        return []
    found = (_ITERATION_DIR.fullmatch(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def untracked_iterations(root: str) -> list[int]:
    """Iterations of ``root`` newer than its tracker (all of them without one), ascending."""
    latest = read_latest_iteration(root)
    return [it for it in _iterations(root) if latest is None or it > latest]


def retire_iterations(root: str, retain_interval: int) -> list[int]:
    """Delete the iterations of ``root`` older than the tracker's that are not multiples of
    ``retain_interval`` (Megatron's --save-retain-interval: the latest checkpoint and every
    ``retain_interval``-th stay); returns them. Run it on one rank, after the tracker moved."""
    latest = read_latest_iteration(root)
    if latest is None:
        return []
    retired = [it for it in _iterations(root) if it < latest and it % retain_interval]
    for iteration in retired:
        shutil.rmtree(iteration_dir(root, iteration))
    return retired


def _verified(path: str, required_files: tuple[str, ...]) -> str | None:
    """None when ``path`` verifies, else what is wrong with it."""
    try:
        verify_checkpoint(path, required_files)
    except (CheckpointingError, CorruptCheckpointError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def adopt_untracked(root: str, required_files: tuple[str, ...] = ()) -> int | None:
    """Move the tracker of ``root`` to its newest complete iteration among those newer than the
    tracker (each verified end to end); log every adoption and every incomplete one (left to
    be replaced). Returns the tracker's iteration. Run it on one rank."""
    for iteration in untracked_iterations(root):
        path = iteration_dir(root, iteration)
        problem = _verified(path, required_files)
        if problem is None:
            write_latest_iteration(root, iteration)
            logger.warning(
                "adopted %s: it was published but the tracker did not name it (a save was interrupted); every "
                "checksum verified",
                path,
            )
        else:
            logger.warning("%s is newer than the tracker but incomplete (%s); a save of it replaces it", path, problem)
    return read_latest_iteration(root)


def settle_existing(root: str, iteration: int, required_files: tuple[str, ...] = ()) -> bool:
    """Before saving ``iteration`` into ``root``: True when an untracked ``iter_*`` of that
    iteration already exists and verifies (the tracker is moved to it and nothing needs to be
    written); an incomplete one is removed (with a log line) and False returned, as when none
    exists. A tracked one is left for the save to refuse (published checkpoints are never
    overwritten). Run it on one rank."""
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path) or iteration not in untracked_iterations(root):
        return False
    problem = _verified(path, required_files)
    if problem is None:
        write_latest_iteration(root, iteration)
        logger.warning("kept %s: an interrupted save had already published it completely (checksums verified)", path)
        return True
    logger.warning("replacing %s: it is newer than the tracker but incomplete (%s)", path, problem)
    shutil.rmtree(path)
    return False
