"""Multi-token prediction: the per-token loss decomposes as main + factor * mean over depths of
the depth-k loss (labels shifted by k), checked against a hand computation; gradients reach
every MTP parameter. (MTP on the last stage under PP2 is covered by the GPT layout tests.)"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    get_mtp_block_spec,
    roll_left,
    shifted_target_mask,
)
from tests.unit_tests.transformer.single_rank import on_single_rank

VOCAB, B, S, DEPTHS, FACTOR = 100, 2, 6, 2, 0.3


def test_roll_left_and_target_mask():
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert roll_left(tokens, 1).tolist() == [[2, 3, 4, 0], [6, 7, 8, 0]]
    assert roll_left(tokens, 3).tolist() == [[4, 0, 0, 0], [8, 0, 0, 0]]
    assert shifted_target_mask(tokens, 1).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]


@on_single_rank
def test_loss_is_main_plus_scaled_mean_of_depth_losses_computed_by_hand(pg):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        normalization="RMSNorm",
        mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=FACTOR,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        VOCAB,
        16,
        position_embedding_type="rope",
        mtp_block_spec=get_gpt_mtp_block_spec(),
        pg_collection=pg,
    )
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, VOCAB, (B, S), generator=gen), torch.randint(0, VOCAB, (B, S), generator=gen)

    loss = model(ids, labels=labels)

    with torch.no_grad():
        positions = torch.arange(S)[None].expand(B, S)
        rotary = model.rotary_pos_emb(positions)
        out_weight = model.output_layer.weight[:VOCAB]

        def ce(hidden_sbh, targets_bs):
            logits = hidden_sbh.transpose(0, 1) @ out_weight.t()
            return F.cross_entropy(logits.reshape(-1, VOCAB), targets_bs.reshape(-1), reduction="none").reshape(B, S)

        hidden = model.decoder(model.embedding(ids, positions), rotary_pos_emb=rotary)
        expected = ce(hidden, labels)
        depth_sum = torch.zeros(B, S)
        for k, layer in enumerate(model.mtp.layers, start=1):
            shifted_ids = torch.cat([ids[:, k:], torch.zeros(B, k, dtype=ids.dtype)], dim=1)
            shifted_labels = torch.cat([labels[:, k:], torch.zeros(B, k, dtype=labels.dtype)], dim=1)
            emb = model.embedding(shifted_ids, positions)
            combined = torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1) @ layer.eh_proj.weight.t()
            hidden = layer.final_layernorm(layer.transformer_layer(combined, rotary_pos_emb=rotary))
            depth_loss = ce(hidden, shifted_labels)
            depth_loss[:, S - k :] = 0.0  # no target beyond the sequence
            depth_sum += depth_loss
        expected = expected + FACTOR * depth_sum / DEPTHS

    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)

    loss.mean().backward()
    for name, param in model.mtp.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reached {name}"


@on_single_rank
def test_inner_layer_is_a_parameter_of_the_spec(pg):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=1)
    seen = []

    class RecordingLayer(torch.nn.Module):
        def __init__(self, config, layer_number, pg_collection=None):
            super().__init__()
            seen.append(layer_number)

        def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
            return hidden_states * 2

    block = get_mtp_block_spec(RecordingLayer).module(
        config, get_mtp_block_spec(RecordingLayer).submodules, pg_collection=pg
    )
    assert isinstance(block, MultiTokenPredictionBlock)
    assert seen == [config.num_layers + 1]  # MTP layers are numbered after the decoder's


@on_single_rank
def test_mtp_block_needs_depths(pg):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    spec = get_mtp_block_spec(get_gpt_layer_local_spec())
    with pytest.raises(ValueError, match="mtp_num_layers >= 1"):
        MultiTokenPredictionBlock(config, spec.submodules, pg_collection=pg)
