"""The step-planned paged attention (the CPU path): it agrees with the reference
``torch_paged_attention``, and a query's result is bitwise the same however its request's tokens
were split into steps and whatever else runs in the step (decode rows, prefill chunks of other
lengths, padding), which the engine's tight-pool == roomy-pool guarantee rests on."""

import torch

from megatron.core.inference.contexts import Capacity, DynamicInferenceContext, StageCacheSpec
from megatron.core.inference.contexts.paged_attention import torch_paged_attention

BS, Q_HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def make_context(max_tokens=64, max_sequence_length=96):
    spec = StageCacheSpec((1,), (), num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BS)
    return DynamicInferenceContext(
        spec,
        Capacity(num_blocks=128, max_requests=8),
        max_sequence_length=max_sequence_length,
        max_tokens_per_step=max_tokens,
        enable_chunked_prefill=True,
    )


def sequences(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        name: tuple(torch.randn(n, heads, DIM, generator=gen) for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
        for name, n in lengths.items()
    }


def run_steps(data, schedules, pad_to_tokens=None, max_tokens=64, max_sequence_length=96):
    """Feed each request's q/k/v through the context in the given steps; returns, per request,
    the attention output of every position, in order."""
    ctx = make_context(max_tokens, max_sequence_length)
    for name, (q, _, _) in data.items():
        ctx.add_request(name, list(range(q.shape[0])))
    outputs = {name: [] for name in data}
    for schedule in schedules:
        batch = ctx.build_step(schedule, pad_to_tokens=pad_to_tokens)
        q, k, v = (torch.zeros(batch.num_padded_tokens, 1, h, DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
        start = 0
        for (name, count), offset in zip(schedule, batch.host_kv_offsets, strict=False):
            fq, fk, fv = data[name]
            q[start : start + count, 0] = fq[offset : offset + count]
            k[start : start + count, 0] = fk[offset : offset + count]
            v[start : start + count, 0] = fv[offset : offset + count]
            start += count
        out = ctx.store_kv_and_attend(1, q, k, v)[:, 0]
        start = 0
        for name, count in schedule:
            outputs[name] += list(out[start : start + count])
            start += count
        ctx.commit_step()
    return {name: torch.stack(rows) for name, rows in outputs.items()}


def test_step_attention_matches_the_reference_kernel():
    data = sequences({"a": 9, "b": 5, "c": 3})
    ctx = make_context()
    for name, (q, _, _) in data.items():
        ctx.add_request(name, list(range(q.shape[0])))
    batch = ctx.build_step([("a", 9), ("b", 5), ("c", 3)], pad_to_tokens=20)
    q = torch.cat([data[n][0] for n in "abc"])
    k = torch.cat([data[n][1] for n in "abc"])
    v = torch.cat([data[n][2] for n in "abc"])
    pad = torch.zeros(3, 1, Q_HEADS, DIM)
    out = ctx.store_kv_and_attend(
        1,
        torch.cat([q[:, None], pad]),
        torch.cat([k[:, None], pad[:, :, :KV_HEADS]]),
        torch.cat([v[:, None], pad[:, :, :KV_HEADS]]),
    )
    key_cache, value_cache = ctx.kv_cache.layer(0)
    expected = torch_paged_attention(
        q, key_cache, value_cache, batch.block_tables, batch.query_lengths, batch.kv_lengths
    )
    torch.testing.assert_close(out[:17, 0], expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[17:], torch.zeros_like(out[17:]))


def test_a_query_gives_the_same_bits_however_the_steps_are_split():
    data = sequences({"a": 11, "b": 7, "c": 5})
    whole = run_steps(data, [[("a", 11), ("b", 7), ("c", 5)]])
    decoded = run_steps(
        data,
        [[("a", 3)], [("b", 7), ("a", 1)], [("a", 1), ("c", 5)]]
        + [[("a", 1), ("b", 0) if False else ("a", 0)][:1] for _ in range(0)]
        + [[("a", 1)]] * 6,
    )
    assert torch.equal(decoded["a"], whole["a"]) and torch.equal(decoded["b"], whole["b"])
    mixed = run_steps(
        data,
        [[("c", 2), ("a", 5)], [("a", 2), ("c", 1), ("b", 3)], [("b", 4), ("a", 3), ("c", 1)], [("c", 1), ("a", 1)]],
        pad_to_tokens=16,
    )
    for name in "abc":
        assert torch.equal(mixed[name], whole[name]), name


def causal_attention(q, k, v):
    """Plain softmax attention of one sequence ``q [n, Q_HEADS, d]`` over ``k, v [n, KV_HEADS, d]``."""
    group = Q_HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    scores = scores.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_requests_over_several_key_tiles_give_the_same_bits_in_any_step_mix():
    """Requests of one and two key tiles (64 keys each) in one step, and decode rows of different
    tile counts side by side, as each request's own whole-prefill result."""
    data = sequences({"a": 90, "b": 40, "c": 70}, seed=1)
    whole = run_steps(data, [[("a", 90), ("b", 40), ("c", 70)]], max_tokens=256)
    for name, (q, k, v) in data.items():
        torch.testing.assert_close(whole[name], causal_attention(q, k, v), rtol=1e-5, atol=1e-6)
    split = run_steps(
        data,
        [[("a", 60), ("b", 30)], [("c", 66), ("a", 1), ("b", 1)]]
        + [[("a", 1), ("b", 1), ("c", 1)]] * 4  # a crosses into its second tile next to b's first
        + [[("a", 1), ("b", 1)]] * 5
        + [[("a", 1)]] * 20,
        pad_to_tokens=128,
        max_tokens=128,
    )
    for name in "abc":
        assert torch.equal(split[name], whole[name]), name


def test_a_chunk_from_mid_tile_across_three_tiles_gives_the_whole_prefill_bits():
    """A prefill chunk that starts inside a key tile and ends two tiles later attends in pieces (one
    per tile its queries end in), next to decode rows and a chunk of another request: each query as
    in its request's whole prefill, and as plain causal attention."""
    data = sequences({"a": 200, "b": 50}, seed=2)
    whole = run_steps(data, [[("a", 200), ("b", 50)]], max_tokens=256, max_sequence_length=256)
    for name, (q, k, v) in data.items():
        torch.testing.assert_close(whole[name], causal_attention(q, k, v), rtol=1e-5, atol=1e-6)
    split = run_steps(
        data,
        [[("a", 30), ("b", 20)], [("b", 1), ("a", 150)], [("a", 1), ("b", 29)]] + [[("a", 19)]],
        pad_to_tokens=160,
        max_tokens=160,
        max_sequence_length=256,
    )
    for name in "ab":
        assert torch.equal(split[name], whole[name]), name


def test_every_product_takes_a_multiple_of_the_row_multiple(monkeypatch):
    """BLAS may round a product with few rows by another kernel (MKL does below 4, and at 5-7 and
    9-11 for a lone matrix on several threads), so a decode query's 2 rows (its GQA group) are
    zero-padded: every product of the torch path has a multiple of PRODUCT_ROW_MULTIPLE rows."""
    from megatron.core.inference.contexts import step_attention

    bmm, baddbmm, heights = torch.bmm, torch.baddbmm, {"bmm": [], "baddbmm": []}

    def recording_bmm(a, b, out=None):
        heights["bmm"].append(a.shape[-2])
        return bmm(a, b, out=out)

    def recording_baddbmm(mask, a, b, out=None):
        heights["baddbmm"].append(a.shape[-2])
        return baddbmm(mask, a, b, out=out)

    monkeypatch.setattr(torch, "bmm", recording_bmm)
    monkeypatch.setattr(torch, "baddbmm", recording_baddbmm)
    data = sequences({"a": 9, "b": 3})
    run_steps(data, [[("a", 9), ("b", 2)], [("b", 1)]])
    multiple = step_attention.PRODUCT_ROW_MULTIPLE
    for products in heights.values():  # the scores' (with their mask) and the weighted values'
        assert products and all(h % multiple == 0 for h in products) and min(products) == multiple


def test_products_give_the_same_row_bits_for_every_row_count():
    """The measured fact the padding rests on, on this machine's BLAS: with the products' operand
    layouts (keys and values read with a row stride), every row of ``mask + Q @ K^T`` and ``P @ V``
    has the same bits whatever the (multiple of PRODUCT_ROW_MULTIPLE) row count and batch size, and
    adding the mask in the product leaves a visible key's score as the plain product gives it."""
    from megatron.core.inference.contexts.step_attention import PRODUCT_ROW_MULTIPLE

    gen = torch.Generator().manual_seed(0)
    for num_keys, head_dim, batch in ((64, 32, 1), (192, 64, 3), (128, 32, 32)):
        keys, values = torch.randn(2 * num_keys * batch, head_dim, generator=gen).view(2, num_keys, batch, head_dim)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        queries = torch.randn(batch, 256, head_dim, generator=gen)
        hidden = torch.rand(batch, 256, num_keys, generator=gen) < 0.3
        mask = torch.zeros(batch, 256, num_keys).masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(torch.randn(batch, 256, num_keys, generator=gen), -1)
        scores, weighted = torch.baddbmm(mask, queries, keys.transpose(1, 2)), torch.bmm(probs, values)
        plain = torch.bmm(queries, keys.transpose(1, 2))
        assert torch.equal(scores[~hidden], plain[~hidden]) and bool((scores[hidden] == float("-inf")).all())
        for rows in range(PRODUCT_ROW_MULTIPLE, 256, PRODUCT_ROW_MULTIPLE):
            masked = torch.baddbmm(mask[:, :rows].contiguous(), queries[:, :rows].contiguous(), keys.transpose(1, 2))
            assert torch.equal(masked, scores[:, :rows])
            assert torch.equal(torch.bmm(probs[:, :rows].contiguous(), values), weighted[:, :rows])


def test_layers_of_a_step_reuse_its_operands_and_give_each_its_own_results():
    """The step's first layer lays out the operands every layer then reuses: later layers (other
    queries, another query head count) give bitwise what a step planned for them alone gives, and
    a returned result is not overwritten by the next layer."""
    from megatron.core.inference.contexts.step_attention import StepAttention

    data = sequences({"a": 70, "b": 5})
    ctx = make_context(max_tokens=96, max_sequence_length=128)
    for name, (q, _, _) in data.items():
        ctx.add_request(name, list(range(q.shape[0])))
    batch = ctx.build_step([("a", 70), ("b", 5)], pad_to_tokens=80)
    k = torch.cat([torch.cat([data[n][1] for n in "ab"]), torch.zeros(5, KV_HEADS, DIM)])
    v = torch.cat([torch.cat([data[n][2] for n in "ab"]), torch.zeros(5, KV_HEADS, DIM)])
    ctx.kv_cache.store(0, batch.slot_mapping, k, v)
    gen = torch.Generator().manual_seed(1)
    queries = [torch.randn(80, heads, DIM, generator=gen) for heads in (Q_HEADS, Q_HEADS, 2 * Q_HEADS, Q_HEADS)]
    shared = ctx._step_attention
    outputs = [shared.attend(q, ctx.kv_cache, 0) for q in queries]
    for q, out in zip(queries, outputs, strict=True):
        alone = StepAttention.plan(
            batch,
            ctx._host_tables[[0, 1]],
            BS,
            q.device,
            kv_heads=KV_HEADS,
            value_slot_offset=ctx.kv_cache.value_slot_offset,
        )
        assert torch.equal(out, alone.attend(q, ctx.kv_cache, 0))
        assert torch.equal(out[75:], torch.zeros_like(out[75:]))


def test_the_workspace_keeps_a_buffer_until_it_must_grow_and_then_at_least_doubles_it():
    from megatron.core.inference.contexts.step_attention import AttentionWorkspace

    space, cpu = AttentionWorkspace(), torch.device("cpu")
    first = space.buffer("keys", 100, cpu)
    assert first.shape == (100,) and space.buffer("keys", 60, cpu).data_ptr() == first.data_ptr()
    grown = space.buffer("keys", 130, cpu)
    assert grown.shape == (130,) and grown.untyped_storage().nbytes() == 200 * 4
    assert space.buffer("keys", 200, cpu).data_ptr() == grown.data_ptr()
    assert space.buffer("keys", 500, cpu).untyped_storage().nbytes() == 500 * 4  # more than double: what is asked
