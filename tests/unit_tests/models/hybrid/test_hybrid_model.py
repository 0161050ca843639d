"""HybridModel's frozen signature, logit dtype, pattern wiring, pipeline-stage errors and
multi-token prediction (single process, and on the last stage under PP2)."""

import inspect

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.hybrid.hybrid_layer_pattern import HybridPatternError
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.tensor_parallel import gather_full_grad
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.models.hybrid.common import SEQ, VOCAB, batch, build_model, collection, hybrid_config

EXPECTED_SIGNATURE = [
    ("config", inspect.Parameter.empty),
    ("hybrid_stack_spec", inspect.Parameter.empty),
    ("vocab_size", inspect.Parameter.empty),
    ("max_sequence_length", inspect.Parameter.empty),
    ("hybrid_layer_pattern", None),
    ("hybrid_attention_ratio", None),
    ("hybrid_mlp_ratio", None),
    ("hybrid_override_pattern", None),
    ("pre_process", True),
    ("post_process", True),
    ("fp16_lm_cross_entropy", False),
    ("parallel_output", True),
    ("share_embeddings_and_output_weights", False),
    ("position_embedding_type", "none"),
    ("rotary_percent", 1.0),
    ("rotary_base", 10000),
    ("scatter_embedding_sequence_parallel", True),
    ("seq_len_interpolation_factor", None),
    ("pg_collection", None),
    ("vp_stage", None),
    ("logit_dtype", None),
    ("make_vocab_size_divisible_by", 128),
]


def test_signature_is_frozen_at_every_positional_index():
    params = list(inspect.signature(HybridModel.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == EXPECTED_SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def _positional_call_binds_every_index():
    pg = collection()
    config = hybrid_config()
    args = [
        config,
        get_hybrid_stack_local_spec(),
        VOCAB,
        SEQ,
        None,
        0.25,
        0.5,
        "M-*-",
        True,
        True,
        True,
        False,
        True,
        "rope",
        0.5,
        500,
        False,
        2.0,
        pg,
        None,
        torch.float64,
    ]
    model = HybridModel(*args)
    return dict(
        pattern=model.layer_pattern.layers,
        vocab=model.vocab_size,
        max_seq=model.max_sequence_length,
        pre=model.pre_process,
        post=model.post_process,
        fp16_ce=model.fp16_lm_cross_entropy,
        parallel_output=model.parallel_output,
        tied=model.share_embeddings_and_output_weights,
        tied_weight=model.output_layer.weight is model.embedding.word_embeddings.weight,
        position=model.position_embedding_type,
        rotary=model.rotary_pos_emb is not None,
        pg=model.pg_collection is pg,
        logit_dtype=model.logit_dtype,
    )


def test_positional_arguments_bind_to_their_names():
    (got,) = run_distributed(_positional_call_binds_every_index, 1)
    assert got == dict(
        pattern="M-*-",
        vocab=VOCAB,
        max_seq=SEQ,
        pre=True,
        post=True,
        fp16_ce=True,
        parallel_output=False,
        tied=True,
        tied_weight=True,
        position="rope",
        rotary=True,
        pg=True,
        logit_dtype=torch.float64,
    )


def _logits_dtypes():
    pg = collection()
    config = hybrid_config(bf16=True)
    ids, labels = batch(0)
    out = {}
    for logit_dtype in (None, torch.float32):
        model = build_model(config, "M*-M", pg, parallel_output=False, logit_dtype=logit_dtype)
        with torch.no_grad():
            logits = model(ids)
            loss = model(ids, labels=labels)
        out[str(logit_dtype)] = (
            model.output_layer.weight.dtype,
            logits.dtype,
            tuple(logits.shape),
            bool(torch.isfinite(logits).all()),
            loss.dtype,
        )
    return out


def test_logit_dtype_gives_fp32_logits_from_a_bf16_model():
    (got,) = run_distributed(_logits_dtypes, 1)
    assert got["None"][:2] == (torch.bfloat16, torch.bfloat16)
    assert got["torch.float32"] == (torch.bfloat16, torch.float32, (2, SEQ, VOCAB), True, torch.float32)


def _errors_from_the_constructor():
    pg = collection()
    messages = []
    for pattern, config in [("M*E-", hybrid_config()), ("M*-", hybrid_config()), ("M*x-", hybrid_config())]:
        with pytest.raises(HybridPatternError) as err:
            build_model(config, pattern, pg)
        messages.append(str(err.value))
    return messages


def test_pattern_errors_surface_from_the_model_constructor():
    ((moe, count, bad_char),) = run_distributed(_errors_from_the_constructor, 1)
    assert "MoE layer ('E') at index 2 of hybrid layer pattern 'M*E-' needs config.num_moe_experts" in moe
    assert "has 3 layers in its main part but config.num_layers is 4" in count
    assert "invalid character 'x' at index 2" in bad_char and bad_char.endswith("    M*x-\n      ^")


def _uneven_stages():
    with pytest.raises(HybridPatternError) as err:
        build_model(hybrid_config(), "M*--", collection(pp=2))
    return str(err.value)


def test_pipeline_split_needs_bars_that_divide_among_stages():
    message, _ = run_distributed(_uneven_stages, 2)
    assert "has 1 pipeline segment(s) separated by '|', which do not divide evenly among 2 pipeline stage(s)" in message


# ---------------------------------------------------------------- multi-token prediction

MTP_PATTERN = "M*|-M/*-"


def mtp_config():
    return hybrid_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.5)


def _mtp_single_process():
    ids, labels = batch(0)
    model = build_model(mtp_config(), MTP_PATTERN, collection())
    plain = build_model(hybrid_config(), MTP_PATTERN.split("/")[0], collection())
    loss = model(ids, labels=labels)
    loss.mean().backward()
    mtp_grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.")}
    return dict(
        loss=loss.detach(),
        plain_loss=plain(ids, labels=labels).detach(),
        inner=[type(layer).__name__ for layer in model.mtp.layers[0].transformer_layer.layers],
        mtp_grads={n: (g is not None and bool(g.abs().sum() > 0)) for n, g in mtp_grads.items()},
        grads={n: p.grad.clone() for n, p in model.named_parameters()},
    )


@pytest.fixture(scope="module")
def mtp_reference():
    (ref,) = run_distributed(_mtp_single_process, 1)
    return ref


def test_mtp_depth_is_built_from_its_pattern_and_gets_gradients(mtp_reference):
    assert mtp_reference["inner"] == ["AttentionLayer", "MLPLayer"]
    assert len(mtp_reference["mtp_grads"]) >= 6 and all(mtp_reference["mtp_grads"].values())
    # Same main weights (layout-invariant init): the MTP term only adds to the loss.
    assert not torch.allclose(mtp_reference["loss"], mtp_reference["plain_loss"])
    assert (mtp_reference["loss"] >= mtp_reference["plain_loss"] - 1e-6).all()


def _mtp_pipeline():
    pg = collection(pp=2)
    config = mtp_config()
    model = build_model(config, MTP_PATTERN, pg)
    ids, labels = batch(0)
    peers = dist.get_process_group_ranks(pg.pp)
    shape = (SEQ, ids.shape[0], config.hidden_size)
    out = dict(has_mtp=model.mtp is not None, mamba_layers=sum(isinstance(m, MambaLayer) for m in model.modules()))
    if pg.rank("pp") == 0:
        hidden = model(ids)
        dist.send(hidden.detach().contiguous(), peers[1])
        grad = torch.empty(shape)
        dist.recv(grad, peers[1])
        hidden.backward(grad)
    else:
        received = torch.empty(shape)
        dist.recv(received, peers[0])
        received.requires_grad_(True)
        model.set_input_tensor(received)
        loss = model(ids, labels=labels)
        loss.mean().backward()
        dist.send(received.grad.contiguous(), peers[0])
        out["loss"] = loss.detach()
    finalize_model_grads(model, pg, config)
    numbers = model.decoder.layer_numbers
    grads = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(numbers[int(parts[2])] - 1)
        grads[".".join(parts)] = gather_full_grad(p, pg)
    out["grads"] = grads
    return out


def test_mtp_lives_on_the_last_stage_under_pp2(mtp_reference):
    first, last = run_distributed(_mtp_pipeline, 2)
    assert not first["has_mtp"] and last["has_mtp"]
    assert first["mamba_layers"] == 1 and last["mamba_layers"] == 1  # "M*" | "-M"; MTP depth is "*-"
    rel = ((last["loss"] - mtp_reference["loss"]).abs().max() / mtp_reference["loss"].abs().max()).item()
    assert rel <= 1e-5
    # Both stages hold the word embedding (the last one for MTP); after finalize both copies
    # carry the full gradient.
    for stage in (first, last):
        for name, grad in stage["grads"].items():
            want = mtp_reference["grads"][name]
            assert ((grad - want).abs().max() / want.abs().max()).item() <= 1e-4, name
    assert set(first["grads"]) | set(last["grads"]) == set(mtp_reference["grads"])
    assert "embedding.word_embeddings.weight" in first["grads"] and "embedding.word_embeddings.weight" in last["grads"]
