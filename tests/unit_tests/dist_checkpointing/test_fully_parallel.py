"""Fully parallel save/load: the greedy assignment, its cache keyed by the complete group
membership, and real round trips that use cached assignments."""

import json
import os

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import AssignmentCache, ShardedTensor, exchange_utils, load, save
from megatron.core.dist_checkpointing.exchange_utils import distribute, greedy_assign
from megatron.core.dist_checkpointing.validation import ShardRecord
from tests.unit_tests.dist_harness import run_distributed

FULL = {
    f"t{i}": torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 1000 * i
    for i, rows in enumerate([8, 6, 4, 2])
}


def test_greedy_assignment_by_hand():
    # Largest first to the least loaded candidate, ties to the lower rank.
    candidates = {"a": [0, 1], "b": [0, 1], "c": [0, 1, 2], "d": [1], "e": [0, 2]}
    sizes = {"a": 40, "b": 30, "c": 20, "d": 10, "e": 10}
    assert greedy_assign(candidates, sizes) == {"a": 0, "b": 1, "c": 2, "d": 1, "e": 2}


def _replicated_state():
    """Every rank holds all tensors; rank r's copy has replica id r (rank 0 is the main)."""
    rank = dist.get_rank()
    return {key: ShardedTensor.from_rank_offsets(key, value.clone(), replica_id=rank) for key, value in FULL.items()}


def _tp2_dp2_state():
    """tp = rank % 2 splits every tensor on dim 0; dp = rank // 2 is the replica id."""
    rank = dist.get_rank()
    tp, dp = rank % 2, rank // 2
    return {
        key: ShardedTensor.from_rank_offsets(key, value.chunk(2)[tp].clone(), (0, tp, 2), replica_id=dp)
        for key, value in FULL.items()
    }


def _records(state):
    return [ShardRecord.of(v) for v in state.values()]


def _cache_per_group(cache_dir):
    rank = dist.get_rank()
    records = _records(_replicated_state())
    world = dist.group.WORLD
    pair = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = pair[rank % 2]
    uncached = {"world": distribute("save", records, world), "pair": distribute("save", records, mine)}
    exchange_utils.GATHER_COUNTS.clear()
    cache = AssignmentCache(cache_dir)
    first = {"world": distribute("save", records, world, cache), "pair": distribute("save", records, mine, cache)}
    gathers_on_miss = dict(exchange_utils.GATHER_COUNTS)
    again = {"world": distribute("save", records, world, cache), "pair": distribute("save", records, mine, cache)}
    dist.barrier()  # every cache file is on disk before any rank reads it back
    cache.clear_memory()
    from_disk = {"world": distribute("save", records, world, cache), "pair": distribute("save", records, mine, cache)}
    gathers_total = dict(exchange_utils.GATHER_COUNTS)
    keys = {
        name: exchange_utils.cache_key("save", tuple(dist.get_process_group_ranks(g)), records)
        for name, g in (("world", world), ("pair", mine))
    }
    dist.barrier()
    # Read back here: under torchrun only the ranks share ``cache_dir`` (each test process has its own tmp_path).
    entries = {name: json.load(open(os.path.join(cache_dir, name))) for name in sorted(os.listdir(cache_dir))}
    return (
        uncached,
        first,
        again,
        from_disk,
        gathers_on_miss,
        gathers_total,
        keys,
        dict(exchange_utils.CACHE_FILE_WRITES),
        entries,
    )


def test_cache_is_keyed_by_complete_group_membership(tmp_path):
    results = run_distributed(_cache_per_group, 4, str(tmp_path))
    for rank, (uncached, first, again, from_disk, on_miss, total, keys, *_) in enumerate(results):
        assert first == uncached and again == uncached and from_disk == uncached
        pair = (0, 2) if rank % 2 == 0 else (1, 3)
        # One gather per distinct group identity, none for memory or disk hits.
        assert on_miss == {(0, 1, 2, 3): 1, pair: 1} and total == on_miss
        assert keys["world"] != keys["pair"]
    world, pair02, pair13 = results[0][0]["world"], results[0][0]["pair"], results[1][0]["pair"]
    # The world group spreads the four tensors over four ranks; [0, 2] holds the mains and
    # spreads them over its two members; [1, 3] holds no main, so it writes nothing.
    assert sorted(p.rank for p in world.pieces) == [0, 1, 2, 3]
    assert sorted(p.rank for p in pair02.pieces) == [0, 0, 2, 2] and pair13.pieces == ()
    entries = results[0][-1]
    assert all(result[-1] == entries for result in results)  # every rank reads the same files
    assert len(entries) == 3  # one entry per group identity
    writes = {}
    for *_, per_rank_writes, _ in results:
        for members, count in per_rank_writes.items():
            writes[members] = writes.get(members, 0) + count
    assert writes == {(0, 1, 2, 3): 1, (0, 2): 1, (1, 3): 1}  # one file writer per group
    for entry in entries.values():
        assert tuple(entry["assignment"]["members"]) in writes


def _round_trip_with_cached_assignments(root, cache_dir):
    rank = dist.get_rank()
    families = {
        "world": (_replicated_state, dist.group.WORLD),
        "pairs": (_tp2_dp2_state, [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]),
    }
    cache = AssignmentCache(cache_dir)
    out = {}
    for name, (make_state, group) in families.items():
        exchange_utils.GATHER_COUNTS.clear()
        for step in (1, 2):
            path = os.path.join(root, f"{name}_{step}")
            save(make_state(), path, parallelization_group=group, assignment_cache=cache, validate=True)
            request = {
                k: ShardedTensor(v.key, None, v.dtype, v.local_shape, v.global_shape, v.global_offset, None)
                for k, v in make_state().items()
            }
            loaded = load(request, path, parallelization_group=group, assignment_cache=cache)
            expected = {k: v.data for k, v in make_state().items()}
            assert all(torch.equal(loaded[k], expected[k]) for k in expected), f"{name} step {step} differs"
        members = tuple(dist.get_process_group_ranks(group))
        out[name] = (dict(exchange_utils.GATHER_COUNTS), members)
    return out


def test_parallel_round_trip_with_cached_assignments(tmp_path):
    root, cache_dir = str(tmp_path / "ckpts"), str(tmp_path / "cache")
    results = run_distributed(_round_trip_with_cached_assignments, 4, root, cache_dir)
    for per_family in results:
        for gathers, members in per_family.values():
            # save and load each gathered once (step 1); step 2 came from the cache
            assert gathers == {members: 2}
    # The replicas really shared the writing: every rank's file holds some pieces.
    for name, expected_writers in (("world_1", {0, 1, 2, 3}), ("pairs_1", {0, 1, 2, 3})):
        meta = json.load(open(os.path.join(root, name, "metadata.json")))
        writers = {int(c["file"].split("_")[2]) for t in meta["tensors"].values() for c in t["chunks"]}
        assert writers == expected_writers
