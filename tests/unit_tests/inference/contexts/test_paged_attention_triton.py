"""The fused Triton paged-attention kernel equals the torch reference on batches mixing
prefill chunks and decode tokens, with GQA, scattered block tables and NaN in unused block
tails and unrelated blocks; it is batch invariant; the backend switch picks it as documented.

Without CUDA the kernel runs under Triton's interpreter on CPU tensors (``TRITON_INTERPRET``
must be set before the kernel's module is imported); with CUDA it runs compiled on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from megatron.core.inference.contexts import (
    Capacity,
    DynamicInferenceContext,
    StageCacheSpec,
)
from megatron.core.inference.contexts.paged_attention import (
    BACKEND_ENV,
    PagedAttentionBackendError,
    paged_attention,
    resolve_backend,
    torch_paged_attention,
)
from megatron.core.inference.contexts.paged_attention_triton import (
    triton_paged_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KV_HEADS, Q_HEADS = 2, 6
# (kv_length, new tokens): a first prefill chunk, a continued chunk, decode tokens
REQUESTS = [(7, 7), (10, 3), (5, 1), (13, 1), (1, 1)]


def poisoned_batch(block_size: int, head_dim: int, dtype=torch.float32, seed: int = 0):
    """Arguments of paged attention for :data:`REQUESTS` on scattered blocks of a NaN-filled
    cache: only the requests' written slots hold numbers."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 20
    key_cache = torch.full((num_blocks, block_size, KV_HEADS, head_dim), float("nan"))
    value_cache = key_cache.clone()
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()  # block num_blocks - 1 pads the tables
    tables = []
    for kv_len, _ in REQUESTS:
        table = [free.pop() for _ in range(-(-kv_len // block_size))]
        for pos in range(kv_len):
            key_cache[table[pos // block_size], pos % block_size] = torch.randn(KV_HEADS, head_dim, generator=gen)
            value_cache[table[pos // block_size], pos % block_size] = torch.randn(KV_HEADS, head_dim, generator=gen)
        tables.append(table)
    block_tables = torch.full((len(REQUESTS), max(map(len, tables)) + 1), num_blocks - 1)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table)
    num_tokens = sum(q for _, q in REQUESTS)
    query = torch.randn(num_tokens, Q_HEADS, head_dim, generator=gen)
    lengths = torch.tensor([q for _, q in REQUESTS]), torch.tensor([kv for kv, _ in REQUESTS])
    tensors = (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), block_tables, *lengths)
    return tuple(t.to(DEVICE) for t in tensors)


@pytest.mark.parametrize("block_size, head_dim", [(4, 8), (6, 12)])
def test_kernel_matches_torch_reference_on_mixed_batch_with_nan_tails(block_size, head_dim):
    args = poisoned_batch(block_size, head_dim)
    out = triton_paged_attention(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch_paged_attention(*args), rtol=0, atol=1e-5)


def test_kernel_honours_softmax_scale():
    args = poisoned_batch(4, 8)
    torch.testing.assert_close(triton_paged_attention(*args, 0.3), torch_paged_attention(*args, 0.3), rtol=0, atol=1e-5)


def test_kernel_keeps_bf16_and_agrees_with_reference_to_bf16_rounding():
    args = poisoned_batch(4, 8, dtype=torch.bfloat16)
    out = triton_paged_attention(*args)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(
        out.float(), torch_paged_attention(*args).float(), rtol=1.6e-2, atol=1e-2
    )  # one bf16 ulp


def test_kernel_result_of_a_token_does_not_depend_on_the_rest_of_the_step():
    query, key_cache, value_cache, block_tables, query_lengths, kv_lengths = poisoned_batch(4, 8)
    batched = triton_paged_attention(query, key_cache, value_cache, block_tables, query_lengths, kv_lengths)
    start = 0
    for row in range(len(REQUESTS)):
        end = start + int(query_lengths[row])
        alone = triton_paged_attention(
            query[start:end],
            key_cache,
            value_cache,
            block_tables[row : row + 1],
            query_lengths[row : row + 1],
            kv_lengths[row : row + 1],
        )
        assert torch.equal(alone, batched[start:end]), row
        start = end


def test_request_rows_of_no_token_and_padding_tokens_change_nothing():
    """The rows of a mixed-step graph: request rows of no token between and after the real ones,
    and packed tokens past the queries; every real token keeps its bits, padding tokens are zero."""
    query, key_cache, value_cache, block_tables, query_lengths, kv_lengths = poisoned_batch(4, 8)
    expected = triton_paged_attention(query, key_cache, value_cache, block_tables, query_lengths, kv_lengths)
    order = [0, None, 1, 2, None, 3, 4, None, None]  # None: a request row of no token
    padding_row = torch.full_like(block_tables[:1], key_cache.shape[0] - 1)
    tables = torch.cat([block_tables[r : r + 1] if r is not None else padding_row for r in order])
    q_lens = torch.stack([query_lengths[r] if r is not None else query_lengths[0] * 0 for r in order])
    kv_lens = torch.stack([kv_lengths[r] if r is not None else kv_lengths[0] * 0 for r in order])
    padded_query = torch.cat([query, torch.randn(5, *query.shape[1:]).to(query)])
    out = triton_paged_attention(padded_query, key_cache, value_cache, tables, q_lens, kv_lens, validate=False)
    assert torch.equal(out[: query.shape[0]], expected)
    assert not out[query.shape[0] :].any()


def test_kernel_rejects_bad_inputs_like_the_reference():
    query, key_cache, value_cache, block_tables, query_lengths, kv_lengths = poisoned_batch(4, 8)
    with pytest.raises(ValueError, match=r"query_lengths sum to 13 but query has 12 tokens"):
        triton_paged_attention(query[:-1], key_cache, value_cache, block_tables, query_lengths, kv_lengths)
    with pytest.raises(ValueError, match=r"query heads \(5\) must be a multiple of KV heads \(2\)"):
        triton_paged_attention(query[:, :5], key_cache, value_cache, block_tables, query_lengths, kv_lengths)


def test_backend_resolution_argument_then_environment_then_device(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert resolve_backend("auto", torch.device("cpu")) == "triton"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(
        PagedAttentionBackendError, match=r"backend 'cuda' is unknown; accepted: \('auto', 'torch', 'triton'\)"
    ):
        resolve_backend("auto", torch.device("cpu"))


@pytest.mark.parametrize(
    "forced, implementation", [("torch", torch_paged_attention), ("triton", triton_paged_attention)]
)
def test_forced_backend_runs_that_implementation(monkeypatch, forced, implementation):
    args = poisoned_batch(4, 8)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert torch.equal(paged_attention(*args, backend=forced), implementation(*args))
    monkeypatch.setenv(BACKEND_ENV, forced)
    assert torch.equal(paged_attention(*args), implementation(*args))


def test_context_hook_uses_the_backend_forced_by_the_environment(monkeypatch):
    """The context's attention hook over a NaN-filled pool (a prompt and a padded step) gives
    the reference's result when the Triton backend is forced."""
    gen = torch.Generator().manual_seed(2)
    spec = StageCacheSpec((1,), (), num_kv_heads=KV_HEADS, head_dim=8, block_size=4)
    ctx = DynamicInferenceContext(
        spec, Capacity(num_blocks=8, max_requests=2), max_sequence_length=16, max_tokens_per_step=16, device=DEVICE
    )
    ctx._skip_private_page_init_for_tests = True  # pages keep their stale NaN tails
    ctx.kv_cache.data.fill_(float("nan"))
    ctx.add_request("a", list(range(6)))
    ctx.add_request("b", list(range(3)))
    ctx.build_step([("a", 6), ("b", 3)], pad_to_tokens=12)
    q = torch.randn(12, 1, Q_HEADS, 8, generator=gen).to(DEVICE)
    k, v = (torch.randn(12, 1, KV_HEADS, 8, generator=gen).to(DEVICE) for _ in range(2))
    outputs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        outputs[backend] = ctx.store_kv_and_attend(1, q, k, v)
    assert torch.isfinite(outputs["triton"]).all()
    torch.testing.assert_close(outputs["triton"], outputs["torch"], rtol=0, atol=1e-5)


LONG = 40  # keys of the long request: three splits of 16


def long_request_cache(block_size=4, head_dim=16, dtype=torch.float32, kv_heads=1, q_heads=2, seed=3):
    """A NaN-filled cache holding one request of :data:`LONG` tokens on shuffled blocks (and a
    second, short request of 5), the queries of every position of both, and their tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 20
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    value_cache = key_cache.clone()
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = []
    for length in (LONG, 5):
        table = [free.pop() for _ in range(-(-length // block_size))]
        for pos in range(length):
            for cache in (key_cache, value_cache):
                cache[table[pos // block_size], pos % block_size] = torch.randn(kv_heads, head_dim, generator=gen)
        tables.append(table)
    queries = torch.randn(LONG + 5, q_heads, head_dim, generator=gen)
    return key_cache.to(dtype), value_cache.to(dtype), queries.to(dtype), tables, num_blocks - 1


def run_kernel(key_cache, value_cache, queries, requests, width, split=16):
    """Attention of ``requests`` = [(table, query rows, kv_length)] packed in order, tables padded
    with the dummy block to ``width`` columns."""
    table = torch.full((len(requests), width), key_cache.shape[0] - 1)
    for row, (blocks, _, _) in enumerate(requests):
        table[row, : len(blocks)] = torch.tensor(blocks)
    query = torch.cat([queries[rows] for _, rows, _ in requests])
    q_lens = torch.tensor([rows.stop - rows.start for _, rows, _ in requests])
    kv_lens = torch.tensor([kv for _, _, kv in requests])
    args = tuple(t.to(DEVICE) for t in (query, key_cache, value_cache, table, q_lens, kv_lens))
    return triton_paged_attention(*args, kv_split_size=split), torch_paged_attention(*args)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_split_kernel_matches_reference_on_long_context_with_nan_tails(dtype, atol):
    key_cache, value_cache, queries, (long_table, short_table), _ = long_request_cache(
        dtype=dtype, kv_heads=KV_HEADS, q_heads=Q_HEADS
    )
    requests = [(long_table, slice(20, LONG), LONG), (short_table, slice(LONG, LONG + 5), 5)]
    out, ref = run_kernel(key_cache, value_cache, queries, requests, width=len(long_table))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


def test_token_bits_do_not_depend_on_chunking_batch_or_table_width():
    """The long request's tokens computed as one prefill, as two chunks next to another request,
    and one at a time as decode tokens in wider tables (more splits) agree bitwise."""
    key_cache, value_cache, queries, (long_table, short_table), _ = long_request_cache()
    short = (short_table, slice(LONG, LONG + 5), 5)
    width = len(long_table)
    whole, _ = run_kernel(key_cache, value_cache, queries, [(long_table, slice(0, LONG), LONG)], width)
    first, _ = run_kernel(key_cache, value_cache, queries, [short, (long_table[:5], slice(0, 18), 18)], 5)
    second, _ = run_kernel(key_cache, value_cache, queries, [(long_table, slice(18, LONG), LONG), short], width + 3)
    assert torch.equal(first[5:], whole[:18]) and torch.equal(second[:22], whole[18:])
    for position in (15, 16, LONG - 1):
        decode, _ = run_kernel(
            key_cache, value_cache, queries, [short, (long_table, slice(position, position + 1), position + 1)], 16
        )
        assert torch.equal(decode[5], whole[position]), position
    # One split (a table of at most 16 keys) gives the bits of the split path.
    single, _ = run_kernel(key_cache, value_cache, queries, [(long_table[:4], slice(0, 14), 14)], 4)
    assert torch.equal(single, whole[:14])


@pytest.mark.gpu(1)
@pytest.mark.parametrize("q_heads, kv_heads", [(16, 16), (32, 8)])
def test_gpu_kernel_at_model_shapes_matches_reference_and_is_split_invariant(q_heads, kv_heads):
    """bf16, head dim 128, blocks of 16, contexts past one 512-key split, NaN-poisoned cache: 64
    decode tokens match the reference, and each equals bitwise the same token computed as the
    last of a prefill chunk (other split count, other batch)."""
    gen = torch.Generator().manual_seed(5)
    block_size, head_dim, requests = 16, 128, 64
    kv_lengths = torch.randint(300, 1500, (requests,), generator=gen)
    blocks = -(-kv_lengths // block_size)
    num_blocks = int(blocks.sum()) + 1
    order = torch.randperm(num_blocks - 1, generator=gen)
    table = torch.full((requests, int(blocks.max())), num_blocks - 1)
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    value_cache = key_cache.clone()
    used = 0
    for row, (length, n) in enumerate(zip(kv_lengths.tolist(), blocks.tolist(), strict=True)):
        table[row, :n] = order[used : used + n]
        used += n
        slots = (table[row, :n, None] * block_size + torch.arange(block_size)).flatten()[:length]
        for cache in (key_cache, value_cache):
            values = torch.randn(length, kv_heads, head_dim, generator=gen)
            cache.view(-1, kv_heads, head_dim)[slots] = values.bfloat16()
    key_cache, value_cache, table = key_cache.cuda(), value_cache.cuda(), table.cuda()
    query = torch.randn(requests, q_heads, head_dim, generator=gen).bfloat16().cuda()
    ones = torch.ones(requests, dtype=torch.long, device="cuda")
    decode = triton_paged_attention(query, key_cache, value_cache, table, ones, kv_lengths.cuda())
    want = torch_paged_attention(query, key_cache, value_cache, table, ones, kv_lengths.cuda())
    assert torch.isfinite(decode).all()
    torch.testing.assert_close(decode.float(), want.float(), rtol=0, atol=2e-2)
    for row in (0, 17, 63):
        chunk = torch.randn(7, q_heads, head_dim, generator=gen).bfloat16().cuda()
        chunk[-1] = query[row]
        lengths = torch.tensor([7], device="cuda"), kv_lengths[row : row + 1].cuda()
        prefill = triton_paged_attention(chunk, key_cache, value_cache, table[row : row + 1, : blocks[row]], *lengths)
        assert torch.equal(prefill[-1], decode[row]), row


@pytest.mark.gpu(1)
def test_gpu_kernel_captured_in_a_cuda_graph_replays_the_eager_bits_for_new_steps():
    """A decode bucket of 8 requests captured once (static query, tables and lengths) and replayed
    for steps whose lengths, tables and queries change, including past a split boundary: each
    replay equals an eager call on the same inputs bitwise."""
    gen = torch.Generator().manual_seed(6)
    block_size, head_dim, q_heads, kv_heads, requests, width = 16, 128, 32, 8, 8, 48
    num_blocks = requests * width + 1
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16().cuda()
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16().cuda()
    query = torch.zeros(requests, q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(requests, width, dtype=torch.long, device="cuda")
    q_lens = torch.ones(requests, dtype=torch.long, device="cuda")
    kv_lens = torch.ones(requests, dtype=torch.long, device="cuda")
    args = (query, key_cache, value_cache, table, q_lens, kv_lens)

    def new_step():
        query.copy_(torch.randn(requests, q_heads, head_dim, generator=gen).bfloat16())
        table.copy_(torch.randperm(num_blocks - 1, generator=gen)[: requests * width].view(requests, width))
        kv_lens.copy_(torch.randint(1, width * block_size + 1, (requests,), generator=gen))

    new_step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_paged_attention(*args, validate=False)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_paged_attention(*args, validate=False)
    for _ in range(3):
        new_step()
        graph.replay()
        eager = triton_paged_attention(*args)
        assert torch.isfinite(eager).all()
        assert torch.equal(captured, eager)
        torch.testing.assert_close(captured.float(), torch_paged_attention(*args).float(), rtol=0, atol=2e-2)
