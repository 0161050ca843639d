"""List what a distributed checkpoint holds: tensors (shape, dtype, size, pieces), object grids
and the common state.

Usage: python tools/checkpoint/inspect.py CHECKPOINT_DIR
Reads only our metadata.json (never unpickles anything).
"""

import os
import sys

# This file is named like the standard library's `inspect`; when run as a script its folder is
# sys.path[0] and would shadow it for every module imported below. The repository root takes
# its place so that `megatron` imports without being installed.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.append(os.path.dirname(os.path.dirname(_HERE)))

import argparse  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

from megatron.core.dist_checkpointing.metadata import read_metadata  # noqa: E402


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def describe(checkpoint_dir: str) -> str:
    """The listing printed by this tool, as text."""
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir")
    args = parser.parse_args(argv)
    print(describe(args.checkpoint_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
