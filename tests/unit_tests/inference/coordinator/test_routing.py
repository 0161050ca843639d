"""Routing state: least pending load, prefix-aware scoring, one entry per request removed once."""

import pytest

from megatron.core.inference.coordinator.routing import LoadRouter, RoutingError
from megatron.core.inference.errors import DuplicateRequestIdError


def test_least_pending_load_wins_and_ties_go_to_the_first_registered():
    router = LoadRouter()
    router.register("a", "A")
    router.register("b", "B")
    picks = [router.route(f"r{i}", "client", [i]) for i in range(5)]
    assert picks == ["a", "b", "a", "b", "a"]
    router.finish("r0")
    router.finish("r2")
    assert router.route("r5", "client", [5]) == "a"  # a: 2 pending, b: 2 pending -> first registered
    assert {e: load.pending for e, load in router.engines.items()} == {"a": 2, "b": 2}
    router.check_invariants()


def test_each_entry_is_removed_exactly_once():
    router = LoadRouter()
    router.register("a", "A")
    router.route("r", "client", [])
    assert router.finish("r").engine == "a"
    assert router.finish("r") is None  # a second terminal reply changes nothing
    assert router.engines["a"].pending == 0 and router.routes == {}


def test_duplicate_ids_and_no_engine():
    router = LoadRouter()
    assert router.route("r", "client", []) is None
    router.register("a", "A")
    router.route("r", "client", [])
    with pytest.raises(DuplicateRequestIdError, match="request id 'r' is already in use by an unfinished request"):
        router.route("r", "other", [])


def test_deregister_hands_back_the_orphans():
    router = LoadRouter()
    router.register("a", "A")
    router.register("b", "B")
    for i in range(4):
        router.route(f"r{i}", f"c{i}", [])
    orphans = router.deregister("a")
    assert sorted(rid for rid, _ in orphans) == ["r0", "r2"]
    assert sorted(router.routes) == ["r1", "r3"]
    router.check_invariants()


def test_a_draining_engine_gets_nothing_new_and_keeps_what_it_serves():
    router = LoadRouter()
    router.register("a", "A")
    router.register("b", "B")
    router.route("r0", "client", [])
    router.drain("b")
    assert [router.route(f"r{i}", "client", [i]) for i in range(1, 3)] == ["a", "a"]
    assert router.live_engines == ["a"] and router.engines["b"].draining
    router.drain("a")
    assert router.route("r3", "client", []) is None and router.live_engines == []
    assert sorted(router.routes) == ["r0", "r1", "r2"] and router.finish("r0").engine == "a"
    router.check_invariants()


def test_prefix_aware_scoring_prefers_the_engine_that_saw_the_prefix():
    router = LoadRouter(prefix_weight=1.0, prefix_block_size=4)
    router.register("a", "A")
    router.register("b", "B")
    shared = list(range(12))  # 3 blocks
    # a keeps winning while its load minus 3 matched blocks stays below b's empty load.
    picks = [router.route(f"r{i}", "c", shared + [i]) for i in range(4)]
    assert picks == ["a", "a", "a", "b"]
    # Without a shared prefix, load alone decides.
    assert router.route("other", "c", [7] * 12) == "b"
    router.check_invariants()


def test_prefix_memory_is_bounded():
    router = LoadRouter(prefix_weight=1.0, prefix_block_size=1, max_prefixes_per_engine=8)
    router.register("a", "A")
    router.route("r", "c", list(range(100)))
    assert len(router.engines["a"].prefixes) == 8


def test_bad_router_options_are_named():
    with pytest.raises(RoutingError, match="prefix_weight must be >= 0"):
        LoadRouter(prefix_weight=-1)
