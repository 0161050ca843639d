"""A one-rank gloo world in the test process, for single-process model tests."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch.distributed as dist

from megatron.core.process_groups import ProcessGroupCollection, RankLayout


@contextlib.contextmanager
def single_rank_collection():
    """Yield the ProcessGroupCollection of a 1-rank world; tear the world down afterwards
    (forked multi-rank tests need the test process without a default group)."""
    with tempfile.TemporaryDirectory(prefix="single_rank_") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield ProcessGroupCollection.from_layout(RankLayout())
        finally:
            dist.destroy_process_group()
