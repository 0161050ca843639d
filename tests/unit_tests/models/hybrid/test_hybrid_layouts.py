"""HybridModel under TP2, TP2 x sequence parallel, GTP2 and PP2 (gloo, 2 ranks) against the
same model in one process: equal per-token losses and logits (rel 1e-5) and equal full
gradients (rel 1e-4). GTP peers read different halves of the batch; the single-process run
sees the concatenated batch with a mean loss. PP2 splits "MM*|-*-" so that stage 1 holds no
Mamba layer; the two stages are driven by hand with send/recv."""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.tensor_parallel import gather_full_grad, gtp
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.models.hybrid.common import SEQ, VOCAB, batch, build_model, collection, hybrid_config

PATTERN = "MM*|-*-"
BATCH = 4


def layer_config(tp=1, sp=False):
    return hybrid_config(num_layers=6, tensor_model_parallel_size=tp, sequence_parallel=sp)


def _global_name(name: str, layer_numbers: list[int]) -> str:
    """Parameter name in the single-process model (stage-local layer index -> global)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(layer_numbers[int(parts[2])] - 1)
    return ".".join(parts)


def _reference():
    ids, labels = batch(0, BATCH)
    pg = collection()
    model = build_model(layer_config(), PATTERN, pg, parallel_output=False)
    with torch.no_grad():
        logits = model(ids)
    loss = model(ids, labels=labels)
    loss.mean().backward()
    return dict(loss=loss.detach(), logits=logits, grads={n: p.grad.clone() for n, p in model.named_parameters()})


@pytest.fixture(scope="module")
def reference():
    (ref,) = run_distributed(_reference, 1)
    return ref


def _stage_by_hand(model, pg, ids, labels):
    """PP2 forward/backward: stage 0 sends hidden states, stage 1 sends their gradient back."""
    peers = dist.get_process_group_ranks(pg.pp)
    first = pg.rank("pp") == 0
    other = peers[1] if first else peers[0]
    shape = (SEQ, ids.shape[0], model.config.hidden_size)
    out = {}
    for with_labels in (False, True):
        if first:
            hidden = model(ids)
            dist.send(hidden.detach().contiguous(), other)
            if with_labels:
                grad = torch.empty(shape)
                dist.recv(grad, other)
                hidden.backward(grad)
        else:
            received = torch.empty(shape)
            dist.recv(received, other)
            received.requires_grad_(with_labels)
            model.set_input_tensor(received)
            if with_labels:
                loss = model(ids, labels=labels)
                loss.mean().backward()
                dist.send(received.grad.contiguous(), other)
                out["loss"] = loss.detach()
            else:
                with torch.no_grad():
                    out["logits"] = model(ids)
    return out


def _run_layout(tp, gtp_size, pp, sp):
    pg = collection(tp=tp, gtp=gtp_size, pp=pp)
    config = layer_config(tp, sp)
    model = build_model(config, PATTERN, pg, parallel_output=False)
    ids, labels = batch(0, BATCH)
    peer = pg.rank("gtp")
    rows = slice(peer * BATCH // gtp_size, (peer + 1) * BATCH // gtp_size)
    ids, labels = ids[rows], labels[rows]
    if pp > 1:
        out = _stage_by_hand(model, pg, ids, labels)
    else:
        with torch.no_grad():
            logits = model(ids)
        gtp.reset_collective_counts()
        loss = model(ids, labels=labels)
        loss.mean().backward()
        out = dict(loss=loss.detach(), logits=logits, counts=dict(gtp.COLLECTIVE_COUNTS))
    finalize_model_grads(model, pg, config)
    layer_numbers = model.decoder.layer_numbers
    out["rows"] = (rows.start, rows.stop)
    out["grads"] = {_global_name(n, layer_numbers): gather_full_grad(p, pg) for n, p in model.named_parameters()}
    out["has_mamba"] = any(isinstance(m, MambaMixer) for m in model.modules())
    out["layer_numbers"] = layer_numbers
    sharded = [(n, p) for n, p in model.named_parameters() if p.gtp_sharded]
    out["gtp_shards"] = {n: (tuple(p.shape), p.gtp_rows, tuple(p.global_shape)) for n, p in sharded}
    out["n_sharded_linears"] = sum(1 for n, _ in sharded if "word_embeddings" not in n)
    out["n_sharded_embeddings"] = len(sharded) - out["n_sharded_linears"]
    out["replicated_mamba"] = {
        n: p.gtp_sharded for n, p in model.named_parameters() if n.endswith(("A_log", "D", "dt_bias", "conv1d_weight"))
    }
    return out


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _check_grads(results, reference):
    """Every parameter's full gradient; vocabulary tables only on the true vocabulary (the
    padding to a multiple of 128 * tp depends on the layout)."""
    seen = set()
    for result in results:
        for name, grad in result["grads"].items():
            want = reference["grads"][name]
            if name.startswith(("embedding.word_embeddings", "output_layer")):
                grad, want = grad[:VOCAB], want[:VOCAB]
            assert _rel(grad, want) <= 1e-4, name
            seen.add(name)
    assert seen == set(reference["grads"])


@pytest.mark.parametrize("tp, sp", [(2, False), (2, True)], ids=["tp2", "tp2_sp"])
def test_tensor_parallel_matches_single_process(reference, tp, sp):
    results = run_distributed(_run_layout, 2, tp, 1, 1, sp)
    for result in results:
        assert _rel(result["loss"], reference["loss"]) <= 1e-5
        assert _rel(result["logits"], reference["logits"]) <= 1e-5
        assert result["gtp_shards"] == {}
    _check_grads(results, reference)


def test_gtp_peers_on_different_batches_match_single_process_on_their_concatenation(reference):
    results = run_distributed(_run_layout, 2, 1, 2, 1, False)
    assert [r["rows"] for r in results] == [(0, 2), (2, 4)]
    for result in results:
        start, stop = result["rows"]
        assert _rel(result["loss"], reference["loss"][start:stop]) <= 1e-5
        assert _rel(result["logits"], reference["logits"][start:stop]) <= 1e-5
        shards = result["gtp_shards"]
        # in_proj packs z, x (64 each), B, C (16 each) and dt (8): 168 rows, 84 per GTP peer.
        assert shards["decoder.layers.0.mixer.in_proj.weight"] == ((84, 32), 168, (168, 32))
        assert shards["decoder.layers.0.mixer.out_proj.weight"] == ((16, 64), 32, (32, 64))
        assert shards["decoder.layers.2.self_attention.linear_qkv.weight"] == ((32, 32), 64, (64, 32))
        assert shards["embedding.word_embeddings.weight"] == ((64, 32), 128, (128, 32))
        for name, (shape, rows, _) in shards.items():
            assert shape[0] == math.ceil(rows / 2), name
        assert result["replicated_mamba"] and not any(result["replicated_mamba"].values())
        # Every sharded linear is gathered in forward and again in backward and its gradient
        # reduce-scattered; the embedding is gathered once and reduce-scattered once.
        linears, embeddings = result["n_sharded_linears"], result["n_sharded_embeddings"]
        assert linears == 13 and embeddings == 1
        assert result["counts"] == {"all_gather": 2 * linears + embeddings, "reduce_scatter": linears + embeddings}
    _check_grads(results, reference)


def test_pipeline_stages_split_at_the_bar_match_single_process(reference):
    first, last = run_distributed(_run_layout, 2, 1, 1, 2, False)
    assert first["layer_numbers"] == [1, 2, 3] and last["layer_numbers"] == [4, 5, 6]
    assert first["has_mamba"] and not last["has_mamba"]
    assert _rel(last["loss"], reference["loss"]) <= 1e-5
    assert _rel(last["logits"], reference["logits"]) <= 1e-5
    _check_grads([first, last], reference)
