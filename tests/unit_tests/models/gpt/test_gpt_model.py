"""GPTModel API: frozen signature, output shapes and dtypes, vocabulary padding, tying, errors."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.transformer import ContextParallelConfigError, PipelineLayoutError
from tests.unit_tests.transformer.single_rank import on_single_rank

SIGNATURE = [
    ("config", inspect.Parameter.empty),
    ("transformer_layer_spec", inspect.Parameter.empty),
    ("vocab_size", inspect.Parameter.empty),
    ("max_sequence_length", inspect.Parameter.empty),
    ("pre_process", True),
    ("post_process", True),
    ("fp16_lm_cross_entropy", False),
    ("parallel_output", True),
    ("share_embeddings_and_output_weights", False),
    ("position_embedding_type", "learned_absolute"),
    ("rotary_percent", 1.0),
    ("rotary_base", 10000),
    ("rope_scaling", False),
    ("rope_scaling_factor", 8.0),
    ("scatter_embedding_sequence_parallel", True),
    ("seq_len_interpolation_factor", None),
    ("mtp_block_spec", None),
    ("pg_collection", None),
    ("vp_stage", None),
    ("logit_dtype", None),
    ("make_vocab_size_divisible_by", 128),
]


def tiny_config(**overrides) -> TransformerConfig:
    return TransformerConfig(**{"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, **overrides})


def test_every_positional_index_binds_the_documented_name():
    params = list(inspect.signature(GPTModel.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


@on_single_rank
def test_old_positional_call_binds_parallel_output_and_leaves_logit_dtype_none(pg):
    model = GPTModel(tiny_config(), get_gpt_layer_local_spec(), 128, 32, True, True, False, False, pg_collection=pg)
    assert model.parallel_output is False and model.logit_dtype is None
    logits = model(torch.randint(0, 128, (2, 8)))
    assert logits.shape == (2, 8, 128) and logits.dtype == torch.float32


def _check_fp32_logits_of_a_bf16_model(pg, device):
    """The output GEMM writes fp32 logits of the bf16 hidden states and weight (equal to an fp32
    GEMM of the same bf16 inputs, not a cast of bf16 logits), and the loss is computed from them."""
    config = tiny_config(bf16=True)
    ids, labels = torch.randint(0, 128, (2, 8), device=device), torch.randint(0, 128, (2, 8), device=device)
    plain = GPTModel(config, get_gpt_layer_local_spec(), 128, 32, pg_collection=pg).to(device)
    model = GPTModel(config, get_gpt_layer_local_spec(), 128, 32, pg_collection=pg, logit_dtype=torch.float32).to(
        device
    )
    model.load_state_dict(plain.state_dict())
    seen = []
    model.output_layer.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
    logits = model(ids)
    (hidden,) = seen  # the bf16 [s, b, h] the output layer received
    weight = model.output_layer.weight.detach()
    assert (hidden.dtype, weight.dtype, logits.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    fp32_gemm = F.linear(hidden.float(), weight.float()).transpose(0, 1)  # the same bf16 inputs, an fp32 GEMM
    exact = F.linear(hidden.double(), weight.double()).transpose(0, 1)
    torch.testing.assert_close(logits, fp32_gemm, rtol=2e-6, atol=2e-6)
    assert (logits.double() - exact).abs().max() < 1e-5  # fp32 accumulation error only
    assert (plain(ids).double() - exact).abs().max() > 1e-4  # a cast of bf16 logits keeps bf16 rounding

    loss = model(ids, labels=labels)
    expected = F.cross_entropy(fp32_gemm.reshape(-1, 128), labels.reshape(-1), reduction="none").reshape(2, 8)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain(ids, labels=labels), expected, rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    grad = model.output_layer.weight.grad
    assert grad.dtype == torch.bfloat16 and grad.abs().sum() > 0


@on_single_rank
def test_logit_dtype_makes_the_output_gemm_write_fp32_logits_that_the_loss_uses(pg):
    _check_fp32_logits_of_a_bf16_model(pg, torch.device("cpu"))


@pytest.mark.gpu(1)
@on_single_rank
def test_on_cuda_the_output_gemm_writes_fp32_logits_of_the_bf16_operands(pg):
    _check_fp32_logits_of_a_bf16_model(pg, torch.device("cuda"))


@on_single_rank
def test_output_dtype_linear_gradients_are_those_of_an_fp32_gemm_of_the_bf16_operands(pg):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer = ColumnParallelLinear(
        16,
        24,
        config=tiny_config(bf16=True),
        init_method=torch.nn.init.normal_,
        bias=False,
        pg_collection=pg,
        output_dtype=torch.float32,
    )
    x = torch.randn(5, 3, 16).to(torch.bfloat16).requires_grad_()
    out, _ = layer(x)
    grad_out = torch.randn(5, 3, 24)
    out.backward(grad_out)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = layer.weight.detach().clone().requires_grad_()
    reference = F.linear(x_ref.float(), w_ref.float())
    reference.backward(grad_out)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, w_ref.grad, rtol=0, atol=0)


@on_single_rank
def test_padded_vocabulary_never_reaches_logits_or_loss(pg):
    model = GPTModel(tiny_config(), get_gpt_layer_local_spec(), 100, 32, parallel_output=False, pg_collection=pg)
    assert model.padded_vocab_size == 128
    ids, labels = torch.randint(0, 100, (2, 8)), torch.randint(0, 100, (2, 8))
    logits = model(ids)
    assert logits.shape == (2, 8, 100)
    loss = model(ids, labels=labels)
    expected = F.cross_entropy(logits.reshape(-1, 100), labels.reshape(-1), reduction="none").reshape(2, 8)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    model.parallel_output = True
    local = model(ids)
    assert local.shape == (2, 8, 128)
    assert (local[..., 100:] == torch.finfo(torch.float32).min).all()
    torch.testing.assert_close(local[..., :100], logits)


@on_single_rank
def test_tied_output_layer_uses_the_embedding_weight(pg):
    model = GPTModel(
        tiny_config(), get_gpt_layer_local_spec(), 128, 32, share_embeddings_and_output_weights=True, pg_collection=pg
    )
    assert model.output_layer.weight is model.embedding.word_embeddings.weight
    assert not hasattr(model.embedding.word_embeddings.weight, "shared_embedding")  # one stage: nothing to sync


@on_single_rank
def test_decoder_input_replaces_the_embedding_and_position_ids_are_used(pg):
    model = GPTModel(
        tiny_config(), get_gpt_layer_local_spec(), 128, 32, position_embedding_type="rope", pg_collection=pg
    ).eval()
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        full = model(ids)
        embedded = model.embedding(ids, None)
        assert torch.equal(model(ids, decoder_input=embedded), full)
        # Explicit positions 0..5 are the default; RoPE is relative, so a uniform shift keeps the
        # logits while stretched positions change them.
        assert torch.equal(model(ids, position_ids=torch.arange(6)[None]), full)
        torch.testing.assert_close(model(ids, position_ids=torch.arange(6)[None] + 3), full, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(model(ids, position_ids=torch.arange(6)[None] * 2), full, atol=1e-4)


@on_single_rank
def test_a_context_parallel_config_without_its_cp_group_fails_at_construction(pg):
    message = r"config.context_parallel_size \(2\) differs from the cp group size \(1\)"
    with pytest.raises(ContextParallelConfigError, match=message):
        GPTModel(tiny_config(context_parallel_size=2), get_gpt_layer_local_spec(), 128, 32, pg_collection=pg)


@on_single_rank
def test_unsupported_construction_arguments_are_rejected(pg):
    with pytest.raises(PipelineLayoutError, match="vp_stage=1"):
        GPTModel(tiny_config(), get_gpt_layer_local_spec(), 128, 32, pg_collection=pg, vp_stage=1)
    with pytest.raises(ValueError, match="position_embedding_type must be one of"):
        GPTModel(tiny_config(), get_gpt_layer_local_spec(), 128, 32, position_embedding_type="alibi", pg_collection=pg)
    with pytest.raises(ValueError, match="needs both config.mtp_num_layers >= 1 and an mtp_block_spec"):
        GPTModel(tiny_config(mtp_num_layers=1), get_gpt_layer_local_spec(), 128, 32, pg_collection=pg)


@on_single_rank
def test_return_decoder_output_adds_the_final_hidden_states_and_keeps_logits_and_loss(pg):
    model = GPTModel(tiny_config(), get_gpt_layer_local_spec(), 128, 32, pg_collection=pg).eval()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        logits, hidden = model(ids, return_decoder_output=True)
        loss, hidden_with_labels = model(ids, labels=ids, return_decoder_output=True)
        expected_hidden = model.decoder(model.embed(ids, model.position_ids_for(ids, None)))
        assert torch.equal(logits, model(ids)) and torch.equal(loss, model(ids, labels=ids))
        assert hidden.shape == (8, 2, 32) and torch.equal(hidden, expected_hidden)
        assert torch.equal(hidden_with_labels, hidden)
