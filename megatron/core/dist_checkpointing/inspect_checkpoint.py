"""``megatron-inspect-ckpt``: list what a distributed checkpoint holds: tensors (shape, dtype,
size, pieces), object grids and the common state
(``python -m megatron.core.dist_checkpointing.inspect_checkpoint``).

    megatron-inspect-ckpt CHECKPOINT_DIR

CHECKPOINT_DIR is a checkpoint (an ``iter_*`` directory) or a root whose tracker names one.
Reads only our metadata.json (never unpickles anything).
"""

import argparse
import math
import os
import sys

import torch

from megatron.core.dist_checkpointing.core import iteration_dir, read_latest_iteration
from megatron.core.dist_checkpointing.errors import CheckpointingError, CorruptCheckpointError
from megatron.core.dist_checkpointing.metadata import METADATA_FILENAME, read_metadata


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def describe(checkpoint_dir: str) -> str:
    """The listing printed by this tool, as text; a root is listed at its latest iteration."""
    iteration = read_latest_iteration(checkpoint_dir)
    if not os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILENAME)) and iteration is not None:
        checkpoint_dir = iteration_dir(checkpoint_dir, iteration)
    metadata = read_metadata(checkpoint_dir)
    lines = [f"checkpoint {checkpoint_dir}", f"{'key':<40} {'shape':<18} {'dtype':<10} {'size':>10} pieces"]
    total = 0
    for key, tensor in sorted(metadata.tensors.items()):
        nbytes = math.prod(tensor.global_shape) * torch.empty((), dtype=getattr(torch, tensor.dtype)).element_size()
        total += nbytes
        shape = "x".join(map(str, tensor.global_shape)) or "scalar"
        lines.append(f"{key:<40} {shape:<18} {tensor.dtype:<10} {_size(nbytes):>10} {len(tensor.chunks)}")
    for key, grid in sorted(metadata.objects.items()):
        nbytes = sum(cell.local_shape[0] for cell in grid.cells.values())
        shape = "x".join(map(str, grid.global_shape))
        lines.append(f"{key:<40} {shape:<18} {'object':<10} {_size(nbytes):>10} {len(grid.cells)}")
    lines.append(
        f"{len(metadata.tensors)} tensors ({_size(total)}), {len(metadata.objects)} object grids, "
        f"common state: {'yes' if metadata.common else 'no'}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-inspect-ckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir")
    args = parser.parse_args(argv)
    try:
        print(describe(args.checkpoint_dir))
    except (CheckpointingError, CorruptCheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
