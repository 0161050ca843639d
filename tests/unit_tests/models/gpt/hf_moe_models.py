"""Tiny HuggingFace MoE models (Mixtral, Qwen3-MoE) with random weights, shared by the mapping,
generation and converter tests. Router weights are drawn large so the top-k choice is decisive:
HF's and our rounding never pick different experts."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}


def _decisive(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    return model


def mixtral_model(vocab_size: int, seed: int) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=vocab_size, intermediate_size=48, num_local_experts=4, **SIZES)
    return _decisive(MixtralForCausalLM(config))


def qwen3_moe_model(vocab_size: int, seed: int, norm_topk_prob: bool = True) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE with a head size other than hidden / heads and per-head q/k norms."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        intermediate_size=96,
        moe_intermediate_size=48,
        head_dim=8,
        num_experts=4,
        norm_topk_prob=norm_topk_prob,
        **SIZES,
    )
    return _decisive(Qwen3MoeForCausalLM(config))
