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
)
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.tensor_parallel.helpers import (
    collection,
    data_seed,
    expected_piece,
    gtp_peer_seeds,
    tp_config,
)

SEQ, BATCH, HIDDEN = 4, 2, 6
TOL = dict(rtol=1e-5, atol=1e-6)


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
    g = torch.Generator().manual_seed(seed)
    if ids_range is not None:
        x = torch.randint(0, ids_range, x_shape, generator=g)
    else:
        x = torch.randn(x_shape, generator=g)
    dout = torch.randn(x_shape[:-1] + (out_features,) if ids_range is None else x_shape + (out_features,), generator=g)
    return x, dout


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


def check_weight_layout(param, full, dim, parts, pg, tp, g):
    tp_rows = full.shape[0] // tp if dim == 0 else full.shape[0]
    assert param.shape == (math.ceil(tp_rows / g),) + tuple(param.shape[1:])
    expected = expected_piece(full, dim, parts, pg.rank("tp"), tp, pg.rank("gtp"), g)
    torch.testing.assert_close(param.detach(), expected, rtol=0, atol=0)
    assert param.gtp_sharded == (g > 1) and param.gtp_rows == tp_rows
    assert param.global_shape == tuple(full.shape) and param.partition_dim == dim and param.tensor_model_parallel
    torch.testing.assert_close(gather_full_parameter(param, pg), full, rtol=0, atol=0)


def expect_gtp_counts(g, all_gathers, reduce_scatters):
    expected = {"all_gather": all_gathers, "reduce_scatter": reduce_scatters} if g > 1 else {"all_gather": 0, "reduce_scatter": 0}
    assert gtp.COLLECTIVE_COUNTS == expected
    gtp.reset_collective_counts()


def check_column(pg, tp, g, sp, out_features, parts):
    config = tp_config(tensor_model_parallel_size=tp, sequence_parallel=sp)
    with init_rng_scope(config, "col"):
        layer = ColumnParallelLinear(HIDDEN, out_features, config=config, init_method=init_normal,
                                     output_partition_sizes=parts, pg_collection=pg)
    full = full_weight(config, "col", (out_features, HIDDEN))
    check_weight_layout(layer.weight, full, 0, parts, pg, tp, g)
    bias_full = torch.linspace(-1, 1, out_features)
    with torch.no_grad():
        layer.bias.copy_(expected_piece(bias_full, 0, parts, pg.rank("tp"), tp, 0, 1))
    assert layer.bias.partition_dim == 0 and not layer.bias.gtp_sharded

    x, dout = make_data(data_seed(tp), (SEQ, BATCH, HIDDEN), out_features)
    ref_out, _, ref_db, ref_dx = reference_linear(full, bias_full, x, dout)
    x_local = x.chunk(tp, dim=0)[pg.rank("tp")] if sp else x
    x_local = x_local.clone().requires_grad_(True)
    gtp.reset_collective_counts()
    out, out_bias = layer(x_local)
    assert out_bias is None
    cols = lambda t: expected_piece(t.movedim(-1, 0), 0, parts, pg.rank("tp"), tp, 0, 1).movedim(0, -1)
    torch.testing.assert_close(out, cols(ref_out), **TOL)
    (out * cols(dout)).sum().backward()
    expect_gtp_counts(g, all_gathers=2, reduce_scatters=1)

    # GTP-sharded weight grad = mean over the GTP peers' data of the full-weight grads.
    peer_grads = [reference_linear(full, bias_full, *make_data(s, (SEQ, BATCH, HIDDEN), out_features))[1]
                  for s in gtp_peer_seeds(pg, tp)]
    mean_grad = torch.stack(peer_grads).mean(0)
    torch.testing.assert_close(layer.weight.grad, expected_piece(mean_grad, 0, parts, pg.rank("tp"), tp, pg.rank("gtp"), g), **TOL)
    torch.testing.assert_close(gather_full_grad(layer.weight, pg), mean_grad, **TOL)
    torch.testing.assert_close(layer.bias.grad, expected_piece(ref_db, 0, parts, pg.rank("tp"), tp, 0, 1), **TOL)
    torch.testing.assert_close(x_local.grad, ref_dx.chunk(tp, dim=0)[pg.rank("tp")] if sp else ref_dx, **TOL)


def check_row(pg, tp, g, sp, out_features):
    in_features = 4 * tp
    config = tp_config(tensor_model_parallel_size=tp, sequence_parallel=sp)
    with init_rng_scope(config, "row"):
        layer = RowParallelLinear(in_features, out_features, config=config, init_method=init_normal, pg_collection=pg)
    full = full_weight(config, "row", (out_features, in_features))
    check_weight_layout(layer.weight, full, 1, None, pg, tp, g)
    assert layer.bias.partition_dim == -1 and not layer.bias.tensor_model_parallel
    assert layer.bias.sequence_parallel == sp
    bias_full = torch.linspace(-1, 1, out_features)
    with torch.no_grad():
        layer.bias.copy_(bias_full)

    x, dout = make_data(data_seed(tp), (SEQ, BATCH, in_features), out_features)
    ref_out, _, ref_db, ref_dx = reference_linear(full, bias_full, x, dout)
    x_local = x.chunk(tp, dim=-1)[pg.rank("tp")].clone().requires_grad_(True)
    gtp.reset_collective_counts()
    out, _ = layer(x_local)
    seq_part = (lambda t: t.chunk(tp, dim=0)[pg.rank("tp")]) if sp else (lambda t: t)
    torch.testing.assert_close(out, seq_part(ref_out), **TOL)
    (out * seq_part(dout)).sum().backward()
    expect_gtp_counts(g, all_gathers=2, reduce_scatters=1)

    peer_grads = [reference_linear(full, bias_full, *make_data(s, (SEQ, BATCH, in_features), out_features))[1]
                  for s in gtp_peer_seeds(pg, tp)]
    mean_grad = torch.stack(peer_grads).mean(0)
    torch.testing.assert_close(gather_full_grad(layer.weight, pg), mean_grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, expected_piece(mean_grad, 1, None, pg.rank("tp"), tp, pg.rank("gtp"), g), **TOL)
    # Under SP each rank's bias grad covers only its sequence chunk: the TP sum is the full grad.
    bias_grad = layer.bias.grad.clone()
    if sp and tp > 1:
        dist.all_reduce(bias_grad, group=pg.tp)
    torch.testing.assert_close(bias_grad, ref_db, **TOL)
    torch.testing.assert_close(x_local.grad, ref_dx.chunk(tp, dim=-1)[pg.rank("tp")], **TOL)


def check_embedding(pg, tp, g, vocab):
    config = tp_config(tensor_model_parallel_size=tp)
    with init_rng_scope(config, "embedding"):
        layer = VocabParallelEmbedding(vocab, HIDDEN, config=config, init_method=init_normal, pg_collection=pg)
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
    out = layer(ids)
    torch.testing.assert_close(out, ref_out, **TOL)
    (out * dout).sum().backward()
    expect_gtp_counts(g, all_gathers=1, reduce_scatters=1)  # a lookup's backward needs no weight
    mean_grad = torch.stack([run_reference(s)[3] for s in gtp_peer_seeds(pg, tp)]).mean(0)
    torch.testing.assert_close(gather_full_grad(layer.weight, pg), mean_grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, expected_piece(mean_grad, 0, None, pg.rank("tp"), tp, pg.rank("gtp"), g), **TOL)


def _check_layout(tp, g):
    pg = collection(tp=tp, gtp=g)
    for sp in (False, True):
        check_column(pg, tp, g, sp, out_features=4 * tp, parts=None)
        # TP-local rows 5 (G=2 pads to 6) built from packed parts [4, 2, 4] per TP2 (halved per TP1).
        check_column(pg, tp, g, sp, out_features=5 * tp, parts=[2 * tp, tp, 2 * tp])
        check_row(pg, tp, g, sp, out_features=5)
    check_embedding(pg, tp, g, vocab=5 * tp)
    return True


@pytest.mark.parametrize("tp,g", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["tp1", "tp2", "gtp2", "tp2xgtp2"])
def test_layers_match_plain_torch_with_the_same_full_weight(tp, g):
    # 4 ranks: the spare factor is data parallelism, so GTP peers and DP replicas see different data.
    assert run_distributed(_check_layout, 4, tp, g) == [True] * 4


def _check_gtp4_uneven():
    # G=4 over 5 TP-local rows: shards of 2, 2, 1+1 padding, 0+2 padding.
    pg = collection(gtp=4)
    check_column(pg, 1, 4, False, out_features=5, parts=None)
    check_embedding(pg, 1, 4, vocab=5)
    return True


def test_gtp4_with_a_peer_holding_only_padding():
    assert run_distributed(_check_gtp4_uneven, 4) == [True] * 4
