"""Tiny HuggingFace MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3) with random weights, shared by the mapping,
generation and converter tests. Router weights are drawn large so the top-k choice is decisive:
HF's and our rounding never pick different experts."""

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

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


def deepseek_v3_model(
    vocab_size: int,
    seed: int,
    q_lora_rank: int | None = 24,
    rope_parameters=None,
    v_head_dim: int = 12,
    first_k_dense_replace: int = 1,
):
    """DeepSeek-V3: multi-latent attention (low-rank queries unless ``q_lora_rank`` is None,
    interleaved RoPE, keys of 8 + 4 channels, values of ``v_head_dim``), ``first_k_dense_replace``
    dense layers of three, then MoE layers of 8 experts in 4 groups (2 groups compete, 2 experts
    chosen, weights scaled by 2.5) with a random correction bias and one shared expert."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=first_k_dense_replace,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=v_head_dim,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
        rope_parameters={"rope_theta": 500.0, **(rope_parameters or {"rope_type": "default"})},
        tie_word_embeddings=False,
    )
    model = _decisive(DeepseekV3ForCausalLM(config))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.2, 0.2)
    return model
