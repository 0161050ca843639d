"""Whole models on the fused kernels: a GPT-2-style and a Llama-style GPT and a hybrid stack
give the losses and gradients of the torch path; ``compile_layers`` (regional torch.compile)
gives the eager results bitwise; the loss through the fused linear cross-entropy (a loss mask
given, the trainer's reduction) gives the logits path's loss and gradients."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.fusions import fusion_backend
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.models.hybrid import HybridModel
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec
from megatron.training.training import loss_func
from tests.unit_tests.fusions.kernels import DEVICE
from tests.unit_tests.transformer.single_rank import on_single_rank

VOCAB, SEQ, BATCH = 96, 12, 2
STYLES = {
    "gpt2": dict(normalization="LayerNorm", activation_func=F.gelu, add_bias_linear=True),
    "llama": dict(normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False),
}


def _gpt(style, pg):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, **STYLES[style])
    rope = style == "llama"
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=not rope,
        position_embedding_type="rope" if rope else "learned_absolute",
        pg_collection=pg,
    ).to(DEVICE)


def _loss_and_grads(model, backend):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(DEVICE)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(DEVICE)
    model.zero_grad(set_to_none=True)
    with fusion_backend(backend):
        loss = model(ids, labels=labels)
        (loss * torch.rand(BATCH, SEQ, generator=gen).to(DEVICE)).sum().backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def _assert_close(got, want, **tolerance):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tolerance)


@pytest.mark.parametrize("style", list(STYLES))
@on_single_rank
def test_gpt_on_fused_kernels_matches_the_torch_path(pg, style):
    model = _gpt(style, pg)
    _assert_close(_loss_and_grads(model, "triton"), _loss_and_grads(model, "torch"), rtol=1e-4, atol=1e-5)


@on_single_rank
def test_hybrid_on_fused_kernels_matches_the_torch_path(pg):
    config = TransformerConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        normalization="RMSNorm",
        mamba_head_dim=8,
        mamba_state_dim=8,
    )
    model = HybridModel(config, get_hybrid_stack_local_spec(), VOCAB, SEQ, hybrid_layer_pattern="M*-", pg_collection=pg)
    model = model.to(DEVICE)
    _assert_close(_loss_and_grads(model, "triton"), _loss_and_grads(model, "torch"), rtol=1e-4, atol=1e-5)


@on_single_rank
def test_compiled_layers_give_the_eager_losses_and_grads_bitwise(pg):
    """Inside compiled layers every fused op takes its torch reference, so the eager torch path is
    their oracle (on a GPU the eager Triton kernels round differently)."""
    model = _gpt("llama", pg)
    eager = _loss_and_grads(model, "torch")
    model.decoder.compile_layers(backend="aot_eager")
    compiled = _loss_and_grads(model, "torch")
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager, strict=True))


# Only the loss on Triton: the layers' kernels are checked above, and the interpreter is slow.
LOSS_ONLY = ["norm", "bias_dropout_add", "activation", "rope", "linear_bias"]


def _masked_loss_and_grads(model, fused: bool):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(DEVICE)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(DEVICE)
    loss_mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.25).float().to(DEVICE)
    model.zero_grad(set_to_none=True)
    model.linear_cross_entropy = fused
    with fusion_backend("triton", disabled_ops=LOSS_ONLY):
        assert model.fuses_loss(torch.zeros(1, requires_grad=True, device=DEVICE), loss_mask) == fused
        loss = model(ids, labels=labels, loss_mask=loss_mask)
        reduced, _ = loss_func(loss_mask, loss)  # the trainer's reduction: the masked mean
        (3.0 * reduced).backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


@on_single_rank
def test_gpt_loss_through_the_fused_linear_cross_entropy_matches_the_logits_path(pg):
    model = _gpt("gpt2", pg)  # tied embeddings: the output weight's gradient adds to the embedding's
    _assert_close(_masked_loss_and_grads(model, True), _masked_loss_and_grads(model, False), rtol=1e-4, atol=1e-6)
