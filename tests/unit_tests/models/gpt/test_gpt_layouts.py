"""GPTModel under TP / PP / GTP / sequence parallelism (gloo ranks) equals the single-process
model: per-token loss and logits (rel 1e-5) and every parameter's gathered gradient (rel 1e-4).

Every rank also builds the single-process model itself (on a one-rank sub-grid) from the same
seed, runs it on the concatenated batch of all data ranks, and compares. GTP peers read
different micro-batches (they are in the ``dp_cp_gtp`` data group), so the reference loss is
the mean over the concatenated batch.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.config import TransformerConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.tensor_parallel import gather_full_grad, gather_full_parameter, gtp
from tests.unit_tests.dist_harness import device, run_distributed

VOCAB, SEQ, MICRO_BATCH = 100, 8, 2

VARIANTS = {
    # RMSNorm, SwiGLU, RoPE, GQA, untied, no biases
    "llama": dict(
        config=dict(
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            num_query_groups=2,
        ),
        model=dict(position_embedding_type="rope", share_embeddings_and_output_weights=False),
    ),
    # LayerNorm, GELU, learned positions, biases, tied embeddings
    "gpt2": dict(
        config=dict(normalization="LayerNorm", add_bias_linear=True),
        model=dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True),
    ),
}


def make_config(variant: str, mtp: bool, **parallel) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        mtp_num_layers=1 if mtp else None,
        **VARIANTS[variant]["config"],
        **parallel,
    )


def build_model(variant: str, mtp: bool, config: TransformerConfig, pg: ProcessGroupCollection) -> GPTModel:
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        pp_rank == 0,
        pp_rank == pp_size - 1,
        parallel_output=False,
        mtp_block_spec=get_gpt_mtp_block_spec() if mtp else None,
        pg_collection=pg,
        **VARIANTS[variant]["model"],
    )
    return model.to(device())


def global_name(name: str, model: GPTModel) -> str:
    """Parameter name in the single-process model (decoder layer indexes are global there)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not match:
        return name
    return f"decoder.layers.{model.decoder.layer_numbers[int(match.group(1))] - 1}.{match.group(2)}"


def run_pipeline_step(model: GPTModel, pg: ProcessGroupCollection, ids, labels, hidden_shape):
    """Forward and backward of one micro-batch through the stages of ``pg.pp``, by hand:
    stage 0 forward -> send hidden -> ... -> last stage loss.mean().backward() -> send the input
    gradient back -> ... -> stage 0 backward. Returns the last stage's per-token loss."""
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    ranks = dist.get_process_group_ranks(pg.pp)
    received = None
    if pp_rank > 0:
        received = torch.empty(hidden_shape, device=device())
        dist.recv(received, src=ranks[pp_rank - 1], group=pg.pp)
        received.requires_grad_()
        model.set_input_tensor(received)
    out = model(ids, labels=labels)
    if pp_rank < pp_size - 1:
        dist.send(out.detach().contiguous(), dst=ranks[pp_rank + 1], group=pg.pp)
        grad = torch.empty_like(out)
        dist.recv(grad, src=ranks[pp_rank + 1], group=pg.pp)
        out.backward(grad)
        loss = None
    else:
        out.mean().backward()
        loss = out.detach()
    if pp_rank > 0:
        dist.send(received.grad.contiguous(), dst=ranks[pp_rank - 1], group=pg.pp)
    return loss


def run_logits(model: GPTModel, pg: ProcessGroupCollection, ids, hidden_shape):
    """Forward without labels through the stages; logits on the last stage, else None."""
    pp_rank, pp_size = pg.rank("pp"), pg.size("pp")
    ranks = dist.get_process_group_ranks(pg.pp)
    with torch.no_grad():
        if pp_rank > 0:
            received = torch.empty(hidden_shape, device=device())
            dist.recv(received, src=ranks[pp_rank - 1], group=pg.pp)
            model.set_input_tensor(received)
        out = model(ids)
        if pp_rank < pp_size - 1:
            dist.send(out.contiguous(), dst=ranks[pp_rank + 1], group=pg.pp)
            return None
    return out


def assert_close(actual, expected, rel, what):
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max() / scale
    assert err <= rel, f"{what}: relative error {err.item():.3g} > {rel}"


def _layout_case(variant, mtp, tp, pp, gtp_size, sp):
    pg = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, generalized_tensor_parallel_size=gtp_size
    )
    config = make_config(
        variant,
        mtp,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        generalized_tensor_parallel_size=gtp_size,
        sequence_parallel=sp,
    )
    data_rank, data_size = pg.rank("dp_cp_gtp"), pg.size("dp_cp_gtp")
    tokens = torch.randint(0, VOCAB, (data_size * MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    tokens = tokens.to(device())
    all_ids, all_labels = tokens[:, :-1], tokens[:, 1:]
    mine = slice(data_rank * MICRO_BATCH, (data_rank + 1) * MICRO_BATCH)

    # Single-process reference on this rank: a one-rank sub-grid, the concatenated batch.
    solo_pg = ProcessGroupCollection.from_layout(RankLayout(rank_offset=dist.get_rank()))
    solo = build_model(variant, mtp, make_config(variant, mtp), solo_pg)
    ref_loss = solo(all_ids, labels=all_labels)
    ref_loss.mean().backward()
    with torch.no_grad():
        ref_logits = solo(all_ids)

    gtp.reset_collective_counts()
    model = build_model(variant, mtp, config, pg)
    hidden_shape = (SEQ // (tp if sp else 1), MICRO_BATCH, config.hidden_size)
    loss = run_pipeline_step(model, pg, all_ids[mine], all_labels[mine], hidden_shape)
    finalize_model_grads([model], pg, config)
    logits = run_logits(model, pg, all_ids[mine], hidden_shape)

    if loss is not None:
        assert_close(loss, ref_loss[mine].detach(), 1e-5, "per-token loss")
        assert logits.shape == (MICRO_BATCH, SEQ, VOCAB)
        assert_close(logits, ref_logits[mine], 1e-5, "logits")
    solo_params = dict(solo.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        reference = solo_params[global_name(name, model)]
        if param.gtp_sharded:  # holds only its 1/G share of the TP-local rows (G=gtp_size)
            assert param.shape[0] == -(-param.gtp_rows // gtp_size), name
            assert param.gtp_rows * (tp if param.partition_dim == 0 else 1) == param.global_shape[0], name
        full_value, full_grad = gather_full_parameter(param, pg), gather_full_grad(param, pg)
        # The vocabulary is padded to a TP-dependent size; padded rows never get a gradient.
        rows = min(full_grad.shape[0], reference.shape[0])
        assert not full_grad[rows:].any() and not reference.grad[rows:].any(), name
        assert torch.equal(full_value[:rows], reference[:rows].detach()), f"initial value of {name}"
        assert_close(full_grad[:rows], reference.grad[:rows], 1e-4, f"gradient of {name}")
        checked += 1
    if gtp_size > 1:
        assert gtp.COLLECTIVE_COUNTS["all_gather"] > 0 and gtp.COLLECTIVE_COUNTS["reduce_scatter"] > 0
    return checked


LAYOUTS = {
    "TP2": dict(variant="llama", mtp=False, tp=2, pp=1, gtp_size=1, sp=False),
    "PP2_tied_mtp": dict(variant="gpt2", mtp=True, tp=1, pp=2, gtp_size=1, sp=False),
    "GTP2": dict(variant="llama", mtp=False, tp=1, pp=1, gtp_size=2, sp=False),
    "TP2xSP_tied": dict(variant="gpt2", mtp=False, tp=2, pp=1, gtp_size=1, sp=True),
    "TP2xGTP2_mtp": dict(variant="gpt2", mtp=True, tp=2, pp=1, gtp_size=2, sp=False),
    "TP2xPP2_mtp": dict(variant="llama", mtp=True, tp=2, pp=2, gtp_size=1, sp=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout):
    case = LAYOUTS[layout]
    world = case["tp"] * case["pp"] * case["gtp_size"]
    checked = run_distributed(
        _layout_case, world, case["variant"], case["mtp"], case["tp"], case["pp"], case["gtp_size"], case["sp"]
    )
    assert all(n > 0 for n in checked)
