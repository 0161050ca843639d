"""Issue 21, item 5: NIXL descriptor lists are prepared once per peer registration, and long
imports are pulled in layer groups posted back to back.

Real NIXL over UCX loopback: pulls from the prepared lists land the same bytes as pulls that
describe every run anew; this side's list is prepared once, a peer's once per registration (a
peer that registered memory again is prepared again); runs that are not whole units take the
unprepared path. A decode side pulling one layer group at a time lands the same bytes as one
pull, group by group, and decodes the tokens of a single engine."""

import pytest
import torch

from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.failures import HandoffConfigError
from megatron.core.inference.handoff.metadata import HandoffRecord, SourceLayout
from megatron.core.inference.handoff.plan import KV_REGION, Segment, layer_groups, plan_kv
from megatron.core.inference.handoff.prefill_side import PrefillSide
from megatron.core.inference.handoff.transport import TransferState, TransportError
from tests.unit_tests.inference.handoff.common import (
    GREEDY,
    build_engine,
    build_model,
    drain,
    nixl,
    prefill_records,
    prompts,
    run,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

SHAPE = (2, 3, 10, 4, 2, 8)  # [K/V, layers, blocks, block size, heads, head dim], float32
BLOCK = 4 * 2 * 8 * 4


def _pull(transport, peer, segments) -> None:
    handle = transport.post_pull("r", peer, segments)
    while transport.poll(handle) is TransferState.PENDING:
        pass
    assert handle.state is TransferState.DONE, handle.error
    transport.release(handle)


def _layout(peer, num_blocks):
    return SourceLayout(peer, (1, 4, 6), (), 0, 2, 8, 4, num_blocks, "float32", 0, 1)


def _source(name, seed):
    kv = torch.rand(SHAPE, generator=torch.Generator().manual_seed(seed))
    transport = nixl(name)
    transport.register({KV_REGION: kv}, {KV_REGION: BLOCK})
    return transport, kv


def test_lists_are_prepared_once_per_peer_and_again_when_the_peer_registers_again():
    (first, first_kv), (second, second_kv) = _source("first", 0), _source("second", 1)
    prepared, described = nixl("prepared"), nixl("described")
    buffers = {"prepared": torch.zeros(SHAPE), "described": torch.zeros(SHAPE)}
    prepared.register({KV_REGION: buffers["prepared"]}, {KV_REGION: BLOCK})
    described.register({KV_REGION: buffers["described"]})  # no units: every pull describes its runs
    src_blocks, dst_blocks = [2, 3, 4, 7], [5, 6, 7, 0]
    record = HandoffRecord("r", [0] * 16, 4, src_blocks, [], [0], [0.0], [_layout({}, 10)], False)
    segments = plan_kv(record, _layout({}, 10), src_blocks, dst_blocks)
    assert len(segments) == 2 * 3 * 2  # runs 2..4 -> 5..7 and 7 -> 0 per layer plane
    peers = {"first": first.export(), "second": second.export()}
    assert peers["first"]["units"] == {KV_REGION: BLOCK}

    for name in ("first", "second", "first"):
        for transport in (prepared, described):
            _pull(transport, peers[name], segments)
        assert torch.equal(buffers["prepared"], buffers["described"])
        source_kv = first_kv if name == "first" else second_kv
        assert torch.equal(buffers["prepared"][:, :, dst_blocks], source_kv[:, :, src_blocks])
    assert prepared.local_preparations == 1
    assert prepared.peer_preparations == {first.agent_name: 1, second.agent_name: 1}
    assert prepared.num_prepared_pulls == 3 and described.num_prepared_pulls == 0
    assert described.local_preparations == 0 and not described.peer_preparations

    # The first peer registers a new buffer: its descriptor changes, its list is prepared again.
    new_kv = torch.rand(SHAPE, generator=torch.Generator().manual_seed(2))
    first.register({KV_REGION: new_kv}, {KV_REGION: BLOCK})
    peers["first"] = first.export()
    _pull(prepared, peers["first"], segments)
    assert torch.equal(buffers["prepared"][:, :, dst_blocks], new_kv[:, :, src_blocks])
    assert prepared.peer_preparations == {first.agent_name: 2, second.agent_name: 1}
    assert prepared.local_preparations == 1 and prepared.num_prepared_pulls == 4

    # Half a block is not a whole unit: that pull describes its runs (and lands the same bytes).
    half = Segment(0, KV_REGION, 3 * BLOCK + BLOCK // 2, KV_REGION, 9 * BLOCK, BLOCK // 2)
    _pull(prepared, peers["second"], [half])
    assert prepared.num_prepared_pulls == 4
    landed = buffers["prepared"].reshape(-1).view(torch.uint8)[9 * BLOCK : 9 * BLOCK + BLOCK // 2]
    assert torch.equal(landed, second_kv.reshape(-1).view(torch.uint8)[3 * BLOCK + BLOCK // 2 : 4 * BLOCK])
    for transport in (first, second, prepared, described):
        transport.close()


def test_units_must_divide_their_region():
    transport = nixl("units")
    with pytest.raises(TransportError, match=r"unit 7 of region 'kv' must be a positive divisor of its 15360 bytes"):
        transport.register({KV_REGION: torch.zeros(SHAPE)}, {KV_REGION: 7})
    assert KV_REGION not in transport.regions
    peer = nixl("peer")
    peer.register({KV_REGION: torch.zeros(SHAPE)}, {KV_REGION: BLOCK})
    bad = peer.export() | {"units": {KV_REGION: 7}}
    with pytest.raises(TransportError, match="optionally units"):
        transport.check_peer(bad)
    transport.close()
    peer.close()


def test_layer_groups_cut_the_layers_in_model_order():
    layout = SourceLayout({}, (2, 5), (1, 3, 4), 0, 2, 8, 4, 10, "float32", 0, 1)
    assert layer_groups(layout, None) == [(1, 2, 3, 4, 5)]
    assert layer_groups(layout, 2) == [(1, 2), (3, 4), (5,)]
    with pytest.raises(ValueError, match="layers_per_group must be >= 1, got 0"):
        layer_groups(layout, 0)


@on_single_rank
def test_an_import_pulled_in_layer_groups_lands_group_by_group_and_decodes_as_one_engine(pg):
    model = build_model("hybrid", pg)  # "M*-M": Mamba layer 1, attention layer 2, Mamba layer 4
    prefill = PrefillSide(build_engine(build_model("hybrid", pg), pg, prefix_caching=False), nixl("prefill"))
    with pytest.raises(HandoffConfigError, match="layers_per_pull must be None or an int >= 1, got 0"):
        DecodeSide(build_engine(model, pg), nixl("bad"), layers_per_pull=0)
    decode = DecodeSide(build_engine(model, pg), nixl("decode"), layers_per_pull=1)
    prompt_a, prompt_b = prompts([13, 9], seed=4)
    records = prefill_records(prefill, {"a": prompt_a, "b": prompt_b})
    results = {}
    for request_id in ("a", "b"):
        record = records[request_id]
        decode.submit(request_id, record, GREEDY)
        decode.step()  # the import starts: one pull per layer group, posted back to back
        imp = decode.pulling[request_id]
        assert imp.groups == [0, 1, 2] and [h.num_descriptors for h in imp.handles] == [2, 2, 2]
        landed = [imp.landed_groups()]
        for handle in imp.handles:  # land the groups in order before the engine decodes
            while decode.transport.poll(handle) is TransferState.PENDING:
                pass
            assert handle.state is TransferState.DONE, handle.error
            landed.append(imp.landed_groups())
        assert landed == [0, 1, 2, 3]
        source, target = prefill.engine.context, decode.context
        blocks = imp.plan.block_ids
        assert torch.equal(target.kv_cache.data[:, :, blocks], source.kv_cache.data[:, :, record.block_ids])
        for mine, theirs in (
            (target.mamba_slots.conv, source.mamba_slots.conv),
            (target.mamba_slots.ssm, source.mamba_slots.ssm),
        ):
            assert torch.equal(mine[:, imp.plan.mamba_slot], theirs[:, record.mamba_slot])
        drain(decode, prefill, results)
    # Both imports' six pulls came from lists prepared once for each side.
    assert decode.transport.local_preparations == 1
    assert decode.transport.peer_preparations == {prefill.transport.agent_name: 1}
    assert decode.transport.num_prepared_pulls == 6
    reference = run(build_engine(build_model("hybrid", pg), pg), [prompt_a, prompt_b], GREEDY)
    assert [results["a"]["tokens"], results["b"]["tokens"]] == [reference["0"]["tokens"], reference["1"]["tokens"]]
