"""Run a single-process model test on a forked one-rank gloo world.

The test process itself must never own a gloo process group: forked multi-rank tests that run
later would inherit it and hang destroying it (its threads do not survive the fork).
"""

from __future__ import annotations

import functools
import inspect

from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_harness import run_distributed


def _run_with_collection(test, kwargs):
    test(pg=ProcessGroupCollection.from_layout(RankLayout()), **kwargs)


def on_single_rank(test):
    """Decorate a test taking ``pg`` (a one-rank ProcessGroupCollection) and other pytest
    arguments: its body runs in a forked rank; failures come back with the traceback."""

    @functools.wraps(test)
    def wrapper(**kwargs):
        run_distributed(_run_with_collection, 1, test, kwargs)

    signature = inspect.signature(test)
    wrapper.__signature__ = signature.replace(parameters=[p for n, p in signature.parameters.items() if n != "pg"])
    del wrapper.__wrapped__  # pytest must read the signature above, not the wrapped one
    return wrapper
