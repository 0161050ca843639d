"""Issue 21, item 5: handoff pulls move one descriptor per (layer, K/V, run of consecutive blocks).

Imports take one ascending run of blocks where the pool has one, the plan merges each run into
one segment per layer plane, and the bytes that land (real NIXL over UCX loopback) equal the
source's blocks and Mamba state, and what one descriptor per block moves."""

import pytest
import torch

from megatron.core.inference.contexts.block_allocator import PageReason
from megatron.core.inference.handoff.metadata import HandoffRecord, MambaStateDescriptor, SourceLayout
from megatron.core.inference.handoff.plan import (
    CONV_REGION,
    KV_REGION,
    SSM_REGION,
    Segment,
    block_runs,
    plan_kv,
    plan_mamba,
)
from megatron.core.inference.handoff.transport import TransferState
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    build_engine,
    build_model,
    drain,
    nixl,
    pair,
    prefill_records,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank


def test_block_runs_split_where_either_side_stops_ascending():
    assert block_runs([0, 1, 2, 5, 6, 9, 10], [3, 4, 5, 6, 7, 0, 2]) == [(0, 3, 3), (5, 6, 2), (9, 0, 1), (10, 2, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError, match="3 source blocks but 2 destination blocks"):
        block_runs([0, 1, 2], [0, 1])


# (kind, free blocks of a 32-block decode pool held whole before the import, destination blocks,
# descriptors): GPT has 2 attention layers, the hybrid "M*-M" 1 attention and 2 Mamba layers (a
# conv and an SSM row each); a 13-token prompt fills 4 blocks, prefilled into blocks 0..3.
HOLES = list(range(1, 16, 2))
CASES = [
    ("gpt", HOLES + list(range(20, 32)), [20, 21, 22, 23], 2 * 2 * 1),
    ("gpt", HOLES, [1, 3, 5, 7], 2 * 2 * 4),
    ("hybrid", HOLES + list(range(20, 32)), [20, 21, 22, 23], 2 * 1 * 1 + 2 * 2),
    ("hybrid", HOLES, [1, 3, 5, 7], 2 * 1 * 4 + 2 * 2),
]


@pytest.mark.parametrize("kind, free, destination, descriptors", CASES)
@on_single_rank
def test_an_import_pulls_one_descriptor_per_layer_plane_and_block_run(pg, kind, free, destination, descriptors):
    prefill, decode = pair(kind, pg)
    prompt = prompts([13], seed=3)[0]
    record = prefill_records(prefill, {"r": prompt})["r"]
    assert record.block_ids == [0, 1, 2, 3]
    pool = decode.context.pool
    held = pool.allocate(pool.num_blocks, PageReason.ADMISSION)
    pool.free(free)
    decode.submit("r", record, GREEDY)
    results = {}
    decode.step()  # the import starts: blocks allocated, one pull posted
    (handle,) = decode.pulling["r"].handles
    assert decode.pulling["r"].plan.block_ids == destination
    assert handle.num_descriptors == descriptors
    while decode.transport.poll(handle) is TransferState.PENDING:  # land it before the engine decodes
        pass
    assert handle.state is TransferState.DONE, handle.error
    source, target = prefill.engine.context, decode.context
    assert torch.equal(target.kv_cache.data[:, :, destination], source.kv_cache.data[:, :, record.block_ids]), (
        "imported KV differs from the prefill rank's"
    )
    if kind == "hybrid":
        slot = decode.pulling["r"].plan.mamba_slot
        for mine, theirs in (
            (target.mamba_slots.conv, source.mamba_slots.conv),
            (target.mamba_slots.ssm, source.mamba_slots.ssm),
        ):
            assert torch.equal(mine[:, slot], theirs[:, record.mamba_slot])
    drain(decode, prefill, results)
    pool.free([b for b in held if b not in free])
    reference = run(build_engine(build_model(kind, pg), pg), [prompt], GREEDY)
    assert results["r"]["tokens"] == reference["0"]["tokens"]


def _layout(peer, layers, num_blocks, mamba=None):
    return SourceLayout(peer, layers, (2, 3) if mamba else (), 0, 2, 8, 4, num_blocks + 1, "float32", 0, 1, mamba)


def _per_block_segments(source_kv, local_kv, src_blocks, dst_blocks) -> list[Segment]:
    """One segment per (K/V, layer, block), offsets taken from the tensors themselves."""
    segments = []
    for plane in range(2):
        for layer in range(source_kv.shape[1]):
            for src, dst in zip(src_blocks, dst_blocks, strict=True):
                piece = source_kv[plane, layer, src]
                segments.append(
                    Segment(
                        0,
                        KV_REGION,
                        piece.data_ptr() - source_kv.data_ptr(),
                        KV_REGION,
                        local_kv[plane, layer, dst].data_ptr() - local_kv.data_ptr(),
                        piece.numel() * piece.element_size(),
                    )
                )
    return segments


def test_coalesced_pull_lands_the_same_bytes_as_one_descriptor_per_block():
    layers, src_blocks, dst_blocks = (1, 4, 6), [2, 3, 4, 7, 8], [9, 10, 11, 0, 5]
    generator = torch.Generator().manual_seed(0)
    source_kv = torch.rand(2, 3, 10, 4, 2, 8, generator=generator)
    source_conv, source_ssm = torch.rand(2, 3, 6, generator=generator), torch.rand(2, 3, 4, 5, generator=generator)
    source, coalesced, per_block = nixl("source"), nixl("coalesced"), nixl("per-block")
    source.register({KV_REGION: source_kv, CONV_REGION: source_conv, SSM_REGION: source_ssm})
    peer = source.export()
    mamba = MambaStateDescriptor(3, (6,), (4, 5), "float32", "float32")
    record = HandoffRecord("r", [0] * 20, 4, src_blocks, [], [0], [0.0], [_layout(peer, layers, 9, mamba)], True, 1)
    local = _layout({}, layers, 12, mamba)
    buffers = {}
    for name, transport in (("coalesced", coalesced), ("per_block", per_block)):
        buffers[name] = {
            KV_REGION: torch.zeros(2, 3, 13, 4, 2, 8),
            CONV_REGION: torch.zeros(2, 3, 6),
            SSM_REGION: torch.zeros(2, 3, 4, 5),
        }
        transport.register(buffers[name])
    segments = {
        "coalesced": plan_kv(record, local, src_blocks, dst_blocks) + plan_mamba(record, local, 2),
        "per_block": _per_block_segments(source_kv, buffers["per_block"][KV_REGION], src_blocks, dst_blocks)
        + [
            Segment(
                0,
                region,
                s[layer, 1].data_ptr() - s.data_ptr(),
                region,
                d[layer, 2].data_ptr() - d.data_ptr(),
                s[layer, 1].numel() * 4,
            )
            for region, s, d in (
                (CONV_REGION, source_conv, buffers["per_block"][CONV_REGION]),
                (SSM_REGION, source_ssm, buffers["per_block"][SSM_REGION]),
            )
            for layer in range(2)
        ],
    }
    # runs (2..4 -> 9..11), (7 -> 0), (8 -> 5): 3 per layer plane, and a conv and an SSM row per Mamba layer
    assert len(segments["coalesced"]) == 2 * 3 * 3 + 2 * 2 and len(segments["per_block"]) == 2 * 3 * 5 + 2 * 2
    for name, transport in (("coalesced", coalesced), ("per_block", per_block)):
        handle = transport.post_pull("r", peer, segments[name])
        while transport.poll(handle) is TransferState.PENDING:
            pass
        assert handle.state is TransferState.DONE, handle.error
        transport.release(handle)
    for region in (KV_REGION, CONV_REGION, SSM_REGION):
        assert torch.equal(buffers["coalesced"][region], buffers["per_block"][region]), region
    assert torch.equal(buffers["coalesced"][KV_REGION][:, :, dst_blocks], source_kv[:, :, src_blocks])
    assert torch.equal(buffers["coalesced"][CONV_REGION][:, 2], source_conv[:, 1])
    assert torch.equal(buffers["coalesced"][SSM_REGION][:, 2], source_ssm[:, 1])
    assert not buffers["coalesced"][KV_REGION][:, :, [1, 2, 3, 4, 6, 7, 8, 12]].any()  # nothing else written
    for transport in (source, coalesced, per_block):
        transport.close()
