"""The paged KV cache's store: keys and values land in their slots of the right layer and plane,
in one copy when they are two planes of one tensor, in two otherwise, with the same result."""

import torch
from torch.profiler import ProfilerActivity, profile

from megatron.core.inference.contexts.kv_cache import PagedKVCache, planes_of_one_tensor

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 5, 4, 2, 8


def _stored(key, value, slots, layer=1):
    cache = PagedKVCache(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    cache.data.fill_(float("nan"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cache.store(layer, slots, key, value)
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::index_copy_")
    return cache.data, copies


def test_keys_and_values_land_in_their_slots_in_one_copy_when_they_share_a_buffer():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 6, HEADS, DIM, generator=gen)
    slots = torch.tensor([3, 0, 17, 9, 12, 5])
    shared, shared_copies = _stored(kv[0], kv[1], slots)
    apart, apart_copies = _stored(kv[0].clone(), kv[1].clone(), slots)
    assert (shared_copies, apart_copies) == (1, 2)
    assert torch.equal(shared.nan_to_num(7.0), apart.nan_to_num(7.0))
    for plane in (0, 1):
        flat = shared[plane, 1].reshape(-1, HEADS, DIM)
        assert torch.equal(flat[slots], kv[plane])
        untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        untouched[slots] = False
        assert flat[untouched].isnan().all() and shared[plane, [0, 2]].isnan().all()


def test_planes_of_one_tensor_only_for_equal_layouts_in_order():
    base = torch.randn(2, 4, HEADS, DIM)
    pair = planes_of_one_tensor(base[0], base[1])
    assert pair is not None and torch.equal(pair, base)
    qkv = torch.randn(4, 3 * HEADS * DIM)  # k and v as views of a packed projection
    k, v = (qkv[:, i * HEADS * DIM : (i + 1) * HEADS * DIM].view(4, HEADS, DIM) for i in (1, 2))
    assert torch.equal(planes_of_one_tensor(k, v), torch.stack((k, v)))
    assert planes_of_one_tensor(base[1], base[0]) is None  # second before first
    assert planes_of_one_tensor(base[0], base[0]) is None
    assert planes_of_one_tensor(base[0], base[1].clone()) is None  # another storage
    assert planes_of_one_tensor(base[0], base[1].transpose(1, 2).contiguous().transpose(1, 2)) is None
    assert planes_of_one_tensor(base[0], base[1].to(torch.float64)) is None
