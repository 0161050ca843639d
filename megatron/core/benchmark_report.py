"""How the scripts under ``benchmarks/`` end: the report written as JSON where the script's
``--json`` / ``--output-json`` flag points, and the distributed world the script joined left;
and the GPU busy time their profiles report.

It lives in the package (not in ``benchmarks/``) because the benchmarks also run as plain
scripts (``python benchmarks/NAME.py``), which import only what is installed.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from megatron.core.parallel_state import destroy_distributed


def write_report(report, path: str | None) -> None:
    """Write ``report`` as indented JSON to ``path``; nothing without a path. In a joined world
    only rank 0 writes (every rank holds the same report)."""
    if not path or (dist.is_initialized() and dist.get_rank() != 0):
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


def finish(report, path: str | None, exit_code: int = 0) -> int:
    """A benchmark's last step: :func:`write_report`, then leave the distributed world if the
    script joined one (every rank meets first); returns ``exit_code`` for ``sys.exit``."""
    write_report(report, path)
    destroy_distributed()
    return exit_code


def busy_us(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals: a profile's GPU busy time from its
    kernels' intervals (the rest of the wall time the GPU waited on the host)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy
