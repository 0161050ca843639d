"""Paged attention equals dense causal SDPA on each request's contiguous K/V, for batches
mixing prefill chunks and decode tokens, with GQA, and with NaN in unused block tails and in
unrelated blocks."""

import torch
import torch.nn.functional as F

from megatron.core.inference.contexts import Capacity, DynamicInferenceContext, StageCacheSpec, paged_attention

BS, KV_HEADS, Q_HEADS, DIM = 4, 2, 4, 8


def dense_reference(q, k, v):
    """SDPA of ``q [n, Hq, d]`` (the last n positions) over contiguous ``k, v [L, Hkv, d]``."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask[None, None],
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def test_paged_attention_matches_dense_on_scattered_blocks_with_nan_tails():
    gen = torch.Generator().manual_seed(0)
    num_blocks = 16
    key_cache = torch.full((num_blocks, BS, KV_HEADS, DIM), float("nan"))
    value_cache = torch.full((num_blocks, BS, KV_HEADS, DIM), float("nan"))
    # (kv_length, new tokens): a first prefill chunk, a continued chunk, two decode tokens
    requests = [(7, 7), (10, 3), (5, 1), (13, 1)]
    tables = [[3, 9], [0, 14, 5], [11, 2], [6, 1, 12, 8]]
    dense_k, dense_v, queries = [], [], []
    for (kv_len, q_len), table in zip(requests, tables, strict=True):
        k = torch.randn(kv_len, KV_HEADS, DIM, generator=gen)
        v = torch.randn(kv_len, KV_HEADS, DIM, generator=gen)
        for pos in range(kv_len):
            key_cache[table[pos // BS], pos % BS] = k[pos]
            value_cache[table[pos // BS], pos % BS] = v[pos]
        dense_k.append(k), dense_v.append(v)
        queries.append(torch.randn(q_len, Q_HEADS, DIM, generator=gen))
    block_tables = torch.full((4, 4), 15)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table)
    out = paged_attention(
        torch.cat(queries),
        key_cache,
        value_cache,
        block_tables,
        torch.tensor([q for _, q in requests]),
        torch.tensor([kv for kv, _ in requests]),
    )
    expected = torch.cat([dense_reference(q, k, v) for q, k, v in zip(queries, dense_k, dense_v, strict=True)])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_context_hook_over_steps_matches_dense_attention_of_whole_sequences():
    """Two requests run through the context: chunked prefill mixed with decode steps; each
    step's hook output equals dense attention over the sequence so far."""
    gen = torch.Generator().manual_seed(1)
    spec = StageCacheSpec((3,), (), num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BS)
    ctx = DynamicInferenceContext(
        spec,
        Capacity(num_blocks=10, max_requests=4),
        max_sequence_length=32,
        max_tokens_per_step=16,
        enable_chunked_prefill=True,
    )
    ctx._skip_private_page_init_for_tests = True  # pages keep their stale NaN tails
    ctx.kv_cache.data.fill_(float("nan"))  # stale bytes everywhere, including the dummy block
    lengths = {"a": 11, "b": 6}
    full = {
        r: (
            torch.randn(n + 3, Q_HEADS, DIM, generator=gen),
            torch.randn(n + 3, KV_HEADS, DIM, generator=gen),
            torch.randn(n + 3, KV_HEADS, DIM, generator=gen),
        )
        for r, n in lengths.items()
    }
    ctx.add_request("a", list(range(11)))
    ctx.add_request("b", list(range(6)))
    ctx.build_step([("a", 5), ("b", 6)], pad_to_tokens=12)  # prefill chunk + whole prompt, 1 padding
    schedules = [[("a", 6), ("b", 1)], [("a", 1), ("b", 1)], [("b", 1), ("a", 1)]]
    for step_index in range(4):
        batch = ctx.step
        q, k, v = (torch.zeros(batch.num_padded_tokens, 1, h, DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
        expected = []
        for row, request_id in enumerate(batch.request_ids):
            start, end = int(batch.cu_query_lengths[row]), int(batch.cu_query_lengths[row + 1])
            lo, hi = int(batch.kv_offsets[row]), int(batch.kv_lengths[row])
            fq, fk, fv = full[request_id]
            q[start:end, 0], k[start:end, 0], v[start:end, 0] = fq[lo:hi], fk[lo:hi], fv[lo:hi]
            expected.append(dense_reference(fq[lo:hi], fk[:hi], fv[:hi]))
        out = ctx.store_kv_and_attend(3, q, k, v)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[: batch.num_tokens, 0], torch.cat(expected), rtol=1e-5, atol=1e-6)
        assert torch.equal(out[batch.num_tokens :], torch.zeros_like(out[batch.num_tokens :]))
        ctx.commit_step()
        if step_index == 3:
            break
        for request_id, _ in schedules[step_index]:
            state = ctx.request(request_id)
            if state.num_computed_tokens == len(state.tokens):
                ctx.append_tokens(request_id, [0])
                ctx.ensure_token_capacity(request_id, len(state.tokens), "decode_growth")
        ctx.build_step(schedules[step_index])


def test_padding_tokens_write_only_the_dummy_block():
    spec = StageCacheSpec((1,), (), num_kv_heads=1, head_dim=2, block_size=BS)
    ctx = DynamicInferenceContext(
        spec, Capacity(num_blocks=4, max_requests=2), max_sequence_length=16, max_tokens_per_step=8
    )
    ctx.add_request("a", [1, 2, 3])
    ctx.kv_cache.data.fill_(0)
    batch = ctx.build_step([("a", 3)], pad_to_tokens=8)
    assert batch.slot_mapping[3:].div(BS, rounding_mode="floor").eq(ctx.pool.dummy_block_id).all()
    before = ctx.kv_cache.data[:, :, :-1].clone()
    ones = torch.ones(8, 1, 1, 2)
    ctx.store_kv_and_attend(1, ones, ones * 5, ones * 5)
    changed = (ctx.kv_cache.data[:, :, :-1] != before).any(dim=(0, 1, 3, 4, 5)).nonzero().flatten().tolist()
    assert changed == ctx.request("a").block_ids
