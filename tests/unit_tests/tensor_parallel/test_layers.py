"""Column/Row/Embedding layers against plain torch modules holding the same full weight, under
TP in {1,2} x GTP in {1,2} x sequence parallel on/off, with GTP peers feeding different data."""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelError,
    VocabParallelEmbedding,
    gather_full_grad,
    gather_full_parameter,
    gtp,
    init_rng_scope,
    pad_vocab_size,
)
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.tensor_parallel.helpers import (
    collection,
    data_seed,
    expected_piece,
    gtp_peer_seeds,
    tp_config,
)

SEQ, BATCH, HIDDEN = 4, 2, 6
TOL = dict(rtol=1e-5, atol=1e-6)


def close(actual, expected, **tol):
    """assert_close on CPU: references are computed on CPU, layers may run on the test device."""
    torch.testing.assert_close(actual.detach().cpu(), expected, **(tol or TOL))


def init_normal(t):
    torch.nn.init.normal_(t, std=0.5)


def full_weight(config, key, shape):
    """The contract: the full master weight is init_method applied to an fp32 CPU tensor
    inside init_rng_scope(config, key)."""
    with init_rng_scope(config, key):
        w = torch.empty(shape)
        init_normal(w)
    return w


def make_data(seed, x_shape, out_features, ids_range=None):
    """Input (or token ids) and output gradient of one data stream."""
    g = torch.Generator().manual_seed(seed)
    if ids_range is not None:
        return torch.randint(0, ids_range, x_shape, generator=g), torch.randn(x_shape + (out_features,), generator=g)
    return torch.randn(x_shape, generator=g), torch.randn(x_shape[:-1] + (out_features,), generator=g)


def reference_linear(weight, bias, x, dout):
    """Plain nn.Linear forward/backward; returns (out, weight grad, bias grad, input grad)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        lin.weight.copy_(weight)
        lin.bias.copy_(bias)
    x = x.clone().requires_grad_(True)
    out = lin(x)
    (out * dout).sum().backward()
    return out.detach(), lin.weight.grad, lin.bias.grad, x.grad


def peer_reduce(grads, per_token):
    """GTP peers' full-weight grads combine to their mean (mean loss) or sum (per-token loss)."""
    total = torch.stack(grads).sum(0)
    return total if per_token else total / len(grads)


def check_weight_layout(param, full, dim, parts, pg, tp, g):
    tp_rows = full.shape[0] // tp if dim == 0 else full.shape[0]
    assert param.shape == (math.ceil(tp_rows / g),) + tuple(full.shape[1:] if dim == 0 else (full.shape[1] // tp,))
    close(param, expected_piece(full, dim, parts, pg.rank("tp"), tp, pg.rank("gtp"), g), rtol=0, atol=0)
    assert param.gtp_sharded == (g > 1) and param.gtp_rows == tp_rows
    assert param.global_shape == tuple(full.shape) and param.partition_dim == dim and param.tensor_model_parallel
    assert param.partition_sizes == parts
    close(gather_full_parameter(param, pg), full, rtol=0, atol=0)


def expect_gtp_counts(g, all_gathers, reduce_scatters):
    """Under GTP the gathers/reduce-scatters really ran; at G=1 the plain TP path runs none."""
    expected = (
        {"all_gather": all_gathers, "reduce_scatter": reduce_scatters}
        if g > 1
        else {"all_gather": 0, "reduce_scatter": 0}
    )
    assert gtp.COLLECTIVE_COUNTS == expected
    gtp.reset_collective_counts()


def check_column(pg, tp, g, sp, out_features, parts, per_token=False):
    config = tp_config(tensor_model_parallel_size=tp, sequence_parallel=sp, calculate_per_token_loss=per_token)
    with init_rng_scope(config, "col"):
        layer = ColumnParallelLinear(
            HIDDEN, out_features, config=config, init_method=init_normal, output_partition_sizes=parts, pg_collection=pg
        )
    layer.to(device())
    full = full_weight(config, "col", (out_features, HIDDEN))
    check_weight_layout(layer.weight, full, 0, parts, pg, tp, g)
    bias_full = torch.linspace(-1, 1, out_features)
    with torch.no_grad():
        layer.bias.copy_(expected_piece(bias_full, 0, parts, pg.rank("tp"), tp, 0, 1))
    assert layer.bias.partition_dim == 0 and not layer.bias.gtp_sharded

    x, dout = make_data(data_seed(tp), (SEQ, BATCH, HIDDEN), out_features)
    ref_out, _, ref_db, ref_dx = reference_linear(full, bias_full, x, dout)
    x_local = (x.chunk(tp, dim=0)[pg.rank("tp")] if sp else x).to(device()).requires_grad_(True)
    gtp.reset_collective_counts()
    out, out_bias = layer(x_local)
    assert out_bias is None

    def cols(t):
        return expected_piece(t.movedim(-1, 0), 0, parts, pg.rank("tp"), tp, 0, 1).movedim(0, -1)

    close(out, cols(ref_out))
    (out * cols(dout).to(device())).sum().backward()
    expect_gtp_counts(g, all_gathers=2, reduce_scatters=1)

    peer_grads = [
        reference_linear(full, bias_full, *make_data(s, (SEQ, BATCH, HIDDEN), out_features))[1]
        for s in gtp_peer_seeds(pg, tp)
    ]
    expected_grad = peer_reduce(peer_grads, per_token)
    close(layer.weight.grad, expected_piece(expected_grad, 0, parts, pg.rank("tp"), tp, pg.rank("gtp"), g))
    close(gather_full_grad(layer.weight, pg), expected_grad)
    close(layer.bias.grad, expected_piece(ref_db, 0, parts, pg.rank("tp"), tp, 0, 1))
    close(x_local.grad, ref_dx.chunk(tp, dim=0)[pg.rank("tp")] if sp else ref_dx)


def check_row(pg, tp, g, sp, out_features, per_token=False):
    in_features = 4 * tp
    config = tp_config(tensor_model_parallel_size=tp, sequence_parallel=sp, calculate_per_token_loss=per_token)
    with init_rng_scope(config, "row"):
        layer = RowParallelLinear(in_features, out_features, config=config, init_method=init_normal, pg_collection=pg)
    layer.to(device())
    full = full_weight(config, "row", (out_features, in_features))
    check_weight_layout(layer.weight, full, 1, None, pg, tp, g)
    assert layer.bias.partition_dim == -1 and not layer.bias.tensor_model_parallel
    assert layer.bias.sequence_parallel == sp and not layer.bias.gtp_sharded
    bias_full = torch.linspace(-1, 1, out_features)
    with torch.no_grad():
        layer.bias.copy_(bias_full)

    x, dout = make_data(data_seed(tp), (SEQ, BATCH, in_features), out_features)
    ref_out, _, ref_db, ref_dx = reference_linear(full, bias_full, x, dout)
    x_local = x.chunk(tp, dim=-1)[pg.rank("tp")].to(device()).requires_grad_(True)
    gtp.reset_collective_counts()
    out, _ = layer(x_local)
    seq_part = (lambda t: t.chunk(tp, dim=0)[pg.rank("tp")]) if sp else (lambda t: t)
    close(out, seq_part(ref_out))
    (out * seq_part(dout).to(device())).sum().backward()
    expect_gtp_counts(g, all_gathers=2, reduce_scatters=1)

    peer_grads = [
        reference_linear(full, bias_full, *make_data(s, (SEQ, BATCH, in_features), out_features))[1]
        for s in gtp_peer_seeds(pg, tp)
    ]
    expected_grad = peer_reduce(peer_grads, per_token)
    close(gather_full_grad(layer.weight, pg), expected_grad)
    close(layer.weight.grad, expected_piece(expected_grad, 1, None, pg.rank("tp"), tp, pg.rank("gtp"), g))
    # Under SP each rank's bias grad covers only its sequence chunk: the TP sum is the full grad.
    bias_grad = layer.bias.grad.clone()
    if sp and tp > 1:
        dist.all_reduce(bias_grad, group=pg.tp)
    close(bias_grad, ref_db)
    close(x_local.grad, ref_dx.chunk(tp, dim=-1)[pg.rank("tp")])


def check_embedding(pg, tp, g, vocab):
    config = tp_config(tensor_model_parallel_size=tp)
    with init_rng_scope(config, "embedding"):
        layer = VocabParallelEmbedding(vocab, HIDDEN, config=config, init_method=init_normal, pg_collection=pg)
    layer.to(device())
    full = full_weight(config, "embedding", (vocab, HIDDEN))
    check_weight_layout(layer.weight, full, 0, None, pg, tp, g)

    def run_reference(seed):
        ids, dout = make_data(seed, (BATCH, SEQ), HIDDEN, ids_range=vocab)
        emb = torch.nn.Embedding(vocab, HIDDEN)
        with torch.no_grad():
            emb.weight.copy_(full)
        out = emb(ids)
        (out * dout).sum().backward()
        return ids, dout, out.detach(), emb.weight.grad

    ids, dout, ref_out, _ = run_reference(data_seed(tp))
    gtp.reset_collective_counts()
    out = layer(ids.to(device()))
    close(out, ref_out)
    (out * dout.to(device())).sum().backward()
    expect_gtp_counts(g, all_gathers=1, reduce_scatters=1)  # a lookup's backward needs no weight
    mean_grad = torch.stack([run_reference(s)[3] for s in gtp_peer_seeds(pg, tp)]).mean(0)
    close(gather_full_grad(layer.weight, pg), mean_grad)
    close(layer.weight.grad, expected_piece(mean_grad, 0, None, pg.rank("tp"), tp, pg.rank("gtp"), g))


def _check_layout(tp, g):
    pg = collection(tp=tp, gtp=g)
    for sp in (False, True):
        check_column(pg, tp, g, sp, out_features=4 * tp, parts=None)
        # TP-local rows 5 (G=2 pads to 6) built from packed parts [4, 2, 4] under TP2 ([2, 1, 2] under TP1).
        check_column(pg, tp, g, sp, out_features=5 * tp, parts=[2 * tp, tp, 2 * tp])
        check_row(pg, tp, g, sp, out_features=5)
    check_embedding(pg, tp, g, vocab=5 * tp)
    return True


@pytest.mark.parametrize(
    "tp,g,world",
    [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 4), (2, 1, 4)],
    ids=["tp1-dp2", "tp2", "gtp2", "tp2xgtp2", "tp2-dp2"],
)
def test_layers_match_plain_torch_with_the_same_full_weight(tp, g, world):
    # Every rank outside a TP group reads other data: GTP peers and DP replicas differ.
    assert run_distributed(_check_layout, world, tp, g) == [True] * world


def _check_gtp4_uneven():
    # G=4 over 5 TP-local rows: shards of 2, 2, 1 + 1 padding, 2 padding.
    pg = collection(gtp=4)
    check_column(pg, 1, 4, False, out_features=5, parts=None)
    check_embedding(pg, 1, 4, vocab=5)
    return True


def test_gtp4_with_a_peer_holding_only_padding():
    assert run_distributed(_check_gtp4_uneven, 4) == [True] * 4


def _check_per_token_loss():
    pg = collection(gtp=2)
    check_column(pg, 1, 2, False, out_features=5, parts=None, per_token=True)
    check_row(pg, 1, 2, False, out_features=5, per_token=True)
    return True


def test_per_token_loss_sums_the_gtp_peers_weight_grads():
    assert run_distributed(_check_per_token_loss, 2) == [True, True]


def _check_gather_output_skip_bias_and_full_input():
    pg = collection(tp=2)
    me = pg.rank("tp")
    config = tp_config(tensor_model_parallel_size=2)
    parts = [4, 2, 4]
    with init_rng_scope(config, "col"):
        column = ColumnParallelLinear(
            HIDDEN,
            10,
            config=config,
            init_method=init_normal,
            gather_output=True,
            skip_bias_add=True,
            output_partition_sizes=parts,
            pg_collection=pg,
        )
        row = RowParallelLinear(
            10, 3, config=config, init_method=init_normal, input_is_parallel=False, pg_collection=pg
        )
    with init_rng_scope(config, "col"):
        w_col, w_row = torch.empty(10, HIDDEN), torch.empty(3, 10)
        init_normal(w_col)
        init_normal(w_row)
    column.to(device())
    row.to(device())
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
    ref_h = x @ w_col.t()
    ref_y = ref_h @ w_row.t()  # row bias starts at zero

    h, h_bias = column(x.to(device()))
    close(h, ref_h)  # gathered output in global part order, bias not added
    assert h_bias is column.bias and h_bias.shape == (5,)
    y, y_bias = row(h)
    assert y_bias is None
    close(y, ref_y)
    y.sum().backward()
    ref_col = torch.nn.Parameter(w_col.clone())
    ref_row = torch.nn.Parameter(w_row.clone())
    ((x @ ref_col.t()) @ ref_row.t()).sum().backward()
    close(gather_full_grad(column.weight, pg), ref_col.grad)
    close(row.weight.grad, ref_row.grad.chunk(2, dim=1)[me])
    return True


def test_gather_output_with_packed_parts_skip_bias_add_and_row_input_scatter():
    assert run_distributed(_check_gather_output_skip_bias_and_full_input, 2) == [True, True]


def _check_fp32_output_under_gtp():
    pg = collection(gtp=2)
    config = tp_config(bf16=True, params_dtype=torch.bfloat16)
    with init_rng_scope(config, "col"):
        layer = ColumnParallelLinear(
            HIDDEN, 5, config=config, init_method=init_normal, bias=False, pg_collection=pg, output_dtype=torch.float32
        )
    layer.to(device())
    assert layer.weight.gtp_sharded and layer.weight.dtype == torch.bfloat16
    full = gather_full_parameter(layer.weight, pg).detach().cpu()  # the bf16 weight the GEMM sees
    x, dout = make_data(data_seed(1), (SEQ, BATCH, HIDDEN), 5)
    x = x.to(torch.bfloat16)
    x_local = x.to(device()).requires_grad_(True)
    out, _ = layer(x_local)
    assert out.dtype == torch.float32
    reference_x = x.detach().clone().requires_grad_(True)
    reference_w = full.clone().requires_grad_(True)
    reference = torch.nn.functional.linear(reference_x.float(), reference_w.float())  # an fp32 GEMM of bf16 operands
    close(out, reference.detach(), rtol=0, atol=0)
    out.backward(dout.to(device()))
    reference.backward(dout)
    close(x_local.grad, reference_x.grad, rtol=0, atol=0)
    peers = []
    for seed in gtp_peer_seeds(pg, 1):
        px, pd = make_data(seed, (SEQ, BATCH, HIDDEN), 5)
        peers.append(pd.reshape(-1, 5).t() @ px.to(torch.bfloat16).float().reshape(-1, HIDDEN))
    close(gather_full_grad(layer.weight, pg).float(), peer_reduce(peers, False), rtol=2e-2, atol=2e-2)
    return True


def test_fp32_output_dtype_under_gtp_is_an_fp32_gemm_of_the_gathered_bf16_weight():
    assert run_distributed(_check_fp32_output_under_gtp, 2) == [True, True]


def _check_bad_arguments():
    pg = collection(tp=2)
    config = tp_config(tensor_model_parallel_size=2)
    sp_config = tp_config(tensor_model_parallel_size=2, sequence_parallel=True)
    cases = [
        (
            lambda: ColumnParallelLinear(4, 5, config=config, init_method=init_normal, pg_collection=pg),
            r"ColumnParallelLinear output_size \(5\) must be divisible by tensor_model_parallel_size \(2\)",
        ),
        (
            lambda: ColumnParallelLinear(
                4, 6, config=config, init_method=init_normal, output_partition_sizes=[2, 2], pg_collection=pg
            ),
            r"output_partition_sizes \[2, 2\] must be positive and sum to output_size \(6\)",
        ),
        (
            lambda: ColumnParallelLinear(
                4, 6, config=config, init_method=init_normal, output_partition_sizes=[3, 3], pg_collection=pg
            ),
            r"part of output_partition_sizes \[3, 3\] \(3\) must be divisible by tensor_model_parallel_size \(2\)",
        ),
        (
            lambda: ColumnParallelLinear(
                4, 6, config=sp_config, init_method=init_normal, gather_output=True, pg_collection=pg
            ),
            "gather_output=True is not supported with sequence_parallel",
        ),
        (
            lambda: RowParallelLinear(5, 4, config=config, init_method=init_normal, pg_collection=pg),
            r"RowParallelLinear input_size \(5\) must be divisible by tensor_model_parallel_size \(2\)",
        ),
        (
            lambda: RowParallelLinear(
                4, 4, config=sp_config, init_method=init_normal, input_is_parallel=False, pg_collection=pg
            ),
            "sequence_parallel requires input_is_parallel=True",
        ),
        (
            lambda: VocabParallelEmbedding(7, 4, config=config, init_method=init_normal, pg_collection=pg),
            r"num_embeddings \(7\) must be divisible by tensor_model_parallel_size \(2\); "
            r"pad it with pad_vocab_size \(e.g. 256\)",
        ),
        (
            lambda: RowParallelLinear(0, 4, config=config, init_method=init_normal, pg_collection=pg),
            "input_size must be a positive integer, got 0",
        ),
    ]
    for build, message in cases:
        with pytest.raises(TensorParallelError, match=message):
            build()
    return True


def test_bad_sizes_raise_errors_naming_the_sizes():
    assert run_distributed(_check_bad_arguments, 2) == [True, True]


def test_pad_vocab_size_rounds_up_to_a_multiple_of_divisible_by_times_tp():
    assert pad_vocab_size(50257, 1) == 50304
    assert pad_vocab_size(50257, 2) == 50432
    assert pad_vocab_size(256, 2) == 256
    assert pad_vocab_size(10, 4, divisible_by=1) == 12
    with pytest.raises(TensorParallelError, match="pad_vocab_size needs positive integers, got vocab_size=0"):
        pad_vocab_size(0, 2)
