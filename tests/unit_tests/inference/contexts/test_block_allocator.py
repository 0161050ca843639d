"""Block pool and prefix cache invariants, checked against hand-computed expectations."""

import pytest

from megatron.core.inference.contexts import (
    BlockHashChain,
    BlockPool,
    BlockPoolExhaustedError,
    Capacity,
    DynamicInferenceContext,
    PageReason,
    StageCacheSpec,
    hash_block,
)
from megatron.core.inference.contexts.prefix_cache import ROOT_HASH

BS = 4


def make_context(num_blocks=8, prefix_caching=True):
    spec = StageCacheSpec((1,), (), num_kv_heads=1, head_dim=2, block_size=BS)
    return DynamicInferenceContext(
        spec,
        Capacity(num_blocks=num_blocks, max_requests=8),
        max_sequence_length=64,
        max_tokens_per_step=64,
        enable_prefix_caching=prefix_caching,
    )


def run_prefill(ctx, *request_ids):
    ctx.build_step([(r, len(ctx.request(r).tokens) - ctx.request(r).num_computed_tokens) for r in request_ids])
    ctx.commit_step()


def test_dummy_block_is_last_id_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.dummy_block_id == 5
    handed = pool.allocate(5, PageReason.ADMISSION)
    assert sorted(handed) == [0, 1, 2, 3, 4]
    with pytest.raises(BlockPoolExhaustedError, match=r"asked for 1 KV blocks \(decode_growth\) but only 0 of 5"):
        pool.allocate(1, PageReason.DECODE_GROWTH)
    pool.free(handed)
    assert pool.dummy_block_id not in pool.allocate(5, PageReason.ADMISSION)


def test_exhausted_allocation_takes_nothing():
    pool = BlockPool(3)
    pool.allocate(2, PageReason.ADMISSION)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate(2, PageReason.ADMISSION)
    assert pool.num_free_blocks == 1


def test_reference_counts_follow_sharing_and_freeing():
    pool = BlockPool(4)
    (a,) = pool.allocate(1, PageReason.ADMISSION)
    assert pool.register(a, block_hash=11)
    pool.share([a])
    assert pool.ref_count(a) == 2
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 3
    pool.free([a])
    assert pool.ref_count(a) == 0 and pool.num_free_blocks == 4
    assert pool.find_cached_prefix([11]) == [a]  # still cached while free
    with pytest.raises(ValueError, match="freed more often than it was referenced"):
        pool.free([a])


def test_free_list_is_lru_order_for_cached_blocks_and_uncached_are_reused_first():
    pool = BlockPool(6)
    first, second, plain = pool.allocate(2, "admission"), pool.allocate(2, "admission"), pool.allocate(1, "admission")
    for i, b in enumerate(first + second):
        assert pool.register(b, 100 + i, first[0] if b == first[1] else second[0] if b == second[1] else -1)
    pool.free(first)  # leaf first: first[1], first[0]
    pool.free(second)
    pool.free(plain)
    # uncached blocks head the list; cached ones follow least recently freed first
    assert pool.peek_free(6) == [plain[0], 5, first[1], first[0], second[1], second[0]]
    # a cache hit on a free block unlinks it; freeing it again makes it most recent
    pool.share([first[0]])
    pool.free([first[0]])
    assert pool.peek_free(6) == [plain[0], 5, first[1], second[1], second[0], first[0]]


def test_eviction_takes_leaves_first_and_keeps_ancestors_cached():
    ctx = make_context(num_blocks=4)
    ctx.add_request("a", list(range(13)))  # blocks: 3 full + 1 partial
    run_prefill(ctx, "a")
    chain = ctx.request("a").hash_chain.hashes
    ctx.release_request("a")
    assert ctx.pool.num_cached_blocks == 3
    # taking blocks one by one evicts the deepest cached block each time
    for expected_left in (3, 2, 1, 0):
        ctx.pool.allocate(1, PageReason.ADMISSION)
        cached = ctx.pool.find_cached_prefix(chain)
        assert len(cached) == expected_left == ctx.pool.num_cached_blocks  # a prefix: ancestors kept


def test_chained_hashes_match_independent_computation_and_are_kept():
    tokens = list(range(10))
    chain = BlockHashChain(BS)
    assert chain.extend(tokens) == chain.hashes
    h0 = hash_block(ROOT_HASH, tokens[0:4])
    h1 = hash_block(h0, tokens[4:8])
    assert chain.hashes == [h0, h1]  # tokens 8, 9 form a partial block: never hashed
    assert chain.extend(tokens + [10, 11]) == [hash_block(h1, [8, 9, 10, 11])]
    # same block tokens behind a different prefix hash differently
    assert hash_block(h0, [0, 1, 2, 3]) != h0
    with pytest.raises(ValueError, match="shorter than the 12 tokens"):
        chain.extend(tokens)


def test_partial_tail_block_is_never_registered():
    ctx = make_context()
    ctx.add_request("a", list(range(6)))
    run_prefill(ctx, "a")
    state = ctx.request("a")
    assert ctx.pool.block_hash(state.block_ids[0]) == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert ctx.pool.block_hash(state.block_ids[1]) is None
    assert ctx.pool.num_cached_blocks == 1


def test_blocks_register_only_after_their_kv_is_computed_and_are_shared():
    ctx = make_context()
    ctx.add_request("a", list(range(9)))
    assert ctx.pool.num_cached_blocks == 0  # allocated, not computed
    ctx.build_step([("a", 5)])
    ctx.commit_step()
    assert ctx.pool.num_cached_blocks == 1  # only the first block is computed
    ctx.build_step([("a", 4)])
    ctx.commit_step()
    assert ctx.pool.num_cached_blocks == 2
    cached_tokens = ctx.add_request("b", list(range(8)) + [99, 98])
    a, b = ctx.request("a"), ctx.request("b")
    assert cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert [ctx.pool.ref_count(x) for x in a.block_ids[:2]] == [2, 2]
    assert b.block_ids[2] not in a.block_ids


def test_a_fully_cached_prompt_still_computes_its_last_token():
    ctx = make_context()
    ctx.add_request("a", list(range(8)))
    run_prefill(ctx, "a")
    assert ctx.add_request("b", list(range(8))) == 4  # last block recomputed, not shared


def test_same_step_collision_registers_only_one_block():
    ctx = make_context()
    prompt = list(range(9))
    ctx.add_request("a", prompt)
    ctx.add_request("b", prompt)  # nothing cached yet: both compute the same blocks
    a, b = ctx.request("a"), ctx.request("b")
    assert not set(a.block_ids) & set(b.block_ids)
    run_prefill(ctx, "a", "b")
    assert [ctx.pool.block_hash(x) is not None for x in a.block_ids] == [True, True, False]
    assert all(ctx.pool.block_hash(x) is None for x in b.block_ids)
    assert b.registration_deferred and ctx.num_deferred_registrations == 1
    # the cache maps each hash to a's blocks; b's duplicates return to the pool uncached
    assert ctx.pool.find_cached_prefix(a.hash_chain.hashes) == a.block_ids[:2]
    ctx.release_request("b")
    assert ctx.pool.num_cached_blocks == 2


def test_released_request_hash_chain_is_reused_not_recomputed():
    ctx = make_context()
    ctx.add_request("a", list(range(9)))
    run_prefill(ctx, "a")
    chain = ctx.release_request("a")
    hashes_before = list(chain.hashes)
    ctx.add_request("a", list(range(9)) + [7, 7, 7], hash_chain=chain)
    assert ctx.request("a").hash_chain is chain
    assert chain.hashes[:2] == hashes_before and len(chain.hashes) == 3


def test_import_blocks_are_one_ascending_run_where_uncached_free_blocks_allow():
    pool = BlockPool(10)
    held = pool.allocate(10, PageReason.ADMISSION)
    pool.free([held[i] for i in (1, 3, 4, 6, 7, 8)])  # free runs: [1], [3, 4], [6, 7, 8]
    assert pool.peek_free(3) == [1, 3, 4]  # what any other reason would get
    assert pool.allocate(3, PageReason.IMPORT) == [6, 7, 8]  # the only run of 3
    assert pool.allocate(2, PageReason.IMPORT) == [3, 4]
    assert pool.num_free_blocks == 1 and pool.allocate(1, PageReason.IMPORT) == [1]


def test_import_without_a_long_enough_uncached_run_takes_the_plain_order():
    pool = BlockPool(6)
    chain = BlockHashChain(BS)
    chain.extend(list(range(2 * BS)))
    cached = pool.allocate(2, PageReason.ADMISSION)  # [0, 1], then cached
    pool.register(cached[0], chain.hashes[0])
    pool.register(cached[1], chain.hashes[1], cached[0])
    rest = pool.allocate(4, PageReason.ADMISSION)  # [2, 3, 4, 5]
    pool.free([rest[0], rest[2]])  # uncached free: 2, 4 (no run of 2)
    pool.free(cached)  # cached free, LRU at the tail: 1 (leaf) then 0
    assert pool.peek_free(4) == [2, 4, 1, 0]
    # 0 and 1 are consecutive but cached: an import never evicts out of LRU order.
    assert pool.allocate(3, PageReason.IMPORT) == [2, 4, 1]
    assert pool.num_cached_blocks == 1 and pool.find_cached_prefix(chain.hashes) == [0]
