"""HuggingFace NemotronH (``NemotronHForCausalLM``) <-> HybridModel: config and full state dicts.

State dicts here are whole (unsharded) tensors, as a single-process HybridModel holds them;
sharding them for a parallel layout is the checkpoint tools' job. Our embedding and output
layer have the vocabulary padded (``pad_vocab_size``): padded rows are zero going in and are
dropped coming out.

One numeric difference is inherent: HF's NemotronH mixer clamps the step ``dt`` from below at
``time_step_min``, our mixer (like Megatron's) does not; the two agree whenever
``softplus(dt + dt_bias) >= time_step_min``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.models.hybrid.hybrid_layer_pattern import ATTENTION, MAMBA, MLP, parse_hybrid_pattern


class NemotronHConversionError(ConfigError):
    """A NemotronH config or state dict that our HybridModel cannot represent."""


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (NemotronH's ``relu2`` MLP activation)."""
    return F.relu(x).square()


_ACTIVATIONS = {"relu2": squared_relu, "silu": F.silu, "gelu": F.gelu}

# Per layer kind: (HF key under ``model.layers.{i}.``, our key under ``decoder.layers.{i}.``).
_RENAMES = {
    MAMBA: [
        ("norm.weight", "norm.weight"),
        ("mixer.in_proj.weight", "mixer.in_proj.weight"),
        ("mixer.conv1d.weight", "mixer.conv1d_weight"),
        ("mixer.conv1d.bias", "mixer.conv1d_bias"),
        ("mixer.A_log", "mixer.A_log"),
        ("mixer.D", "mixer.D"),
        ("mixer.dt_bias", "mixer.dt_bias"),
        ("mixer.norm.weight", "mixer.norm.weight"),
        ("mixer.out_proj.weight", "mixer.out_proj.weight"),
    ],
    ATTENTION: [
        ("norm.weight", "norm.weight"),
        ("mixer.o_proj.weight", "self_attention.linear_proj.weight"),
    ],
    MLP: [
        ("norm.weight", "norm.weight"),
        ("mixer.up_proj.weight", "mlp.linear_fc1.weight"),
        ("mixer.down_proj.weight", "mlp.linear_fc2.weight"),
    ],
}
_QKV_HF = ("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight")
_QKV_OURS = "self_attention.linear_qkv.weight"


@dataclass(frozen=True)
class NemotronHModelArgs:
    """What HybridModel needs besides its layer spec, translated from a NemotronHConfig."""

    config: TransformerConfig
    hybrid_layer_pattern: str
    vocab_size: int
    max_sequence_length: int
    share_embeddings_and_output_weights: bool


def nemotron_h_model_args(hf_config, **config_overrides) -> NemotronHModelArgs:
    """Translate a ``transformers.NemotronHConfig``; ``config_overrides`` go to TransformerConfig
    (parallel sizes, dtype, ...). Raises NemotronHConversionError for features we lack."""
    unsupported = [
        (hf_config.attention_bias or hf_config.mlp_bias or hf_config.use_bias,
         "biases in linear layers (attention_bias / mlp_bias / use_bias must be False)"),
        (not hf_config.use_conv_bias, "a Mamba conv without bias (use_conv_bias must be True)"),
        (hf_config.mamba_hidden_act != "silu", f"mamba_hidden_act {hf_config.mamba_hidden_act!r} (only 'silu')"),
        (hf_config.mlp_hidden_act not in _ACTIVATIONS,
         f"mlp_hidden_act {hf_config.mlp_hidden_act!r} (accepted: {', '.join(_ACTIVATIONS)})"),
        (hf_config.num_nextn_predict_layers, "multi-token prediction layers (num_nextn_predict_layers must be 0)"),
    ]
    problems = [what for bad, what in unsupported if bad]
    if problems:
        raise NemotronHConversionError("NemotronH config uses " + "; ".join(problems))
    pattern = hf_config.hybrid_override_pattern
    parse_hybrid_pattern(pattern)  # rejects MoE ('E') with a message pointing at it
    fields = dict(
        num_layers=len(pattern),
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_config.head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.layer_norm_epsilon,
        activation_func=_ACTIVATIONS[hf_config.mlp_hidden_act],
        gated_linear_unit=False,
        add_bias_linear=False,
        hidden_dropout=float(hf_config.hidden_dropout),
        attention_dropout=float(hf_config.attention_dropout),
        init_method_std=hf_config.initializer_range,
        mamba_state_dim=hf_config.ssm_state_size,
        mamba_head_dim=hf_config.mamba_head_dim,
        mamba_num_groups=hf_config.n_groups,
        mamba_num_heads=hf_config.mamba_num_heads,
        mamba_d_conv=hf_config.conv_kernel,
        mamba_chunk_size=hf_config.chunk_size,
    )
    return NemotronHModelArgs(
        config=TransformerConfig(**(fields | config_overrides)),
        hybrid_layer_pattern=pattern,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise NemotronHConversionError(f"vocabulary of {t.shape[0]} rows does not fit a padded vocabulary of {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


def nemotron_h_to_hybrid_state_dict(hf_state: dict, pattern: str, padded_vocab_size: int,
                                    tie_word_embeddings: bool = False) -> dict:
    """Our HybridModel state dict (keys of a single-process model) from an HF NemotronH one."""
    layers = parse_hybrid_pattern(pattern).layers
    ours = {"embedding.word_embeddings.weight": _pad_rows(hf_state["model.embeddings.weight"], padded_vocab_size),
            "decoder.final_norm.weight": hf_state["model.norm_f.weight"]}
    if not tie_word_embeddings:
        ours["output_layer.weight"] = _pad_rows(hf_state["lm_head.weight"], padded_vocab_size)
    for i, symbol in enumerate(layers):
        hf_prefix, our_prefix = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_key, our_key in _RENAMES[symbol]:
            ours[our_prefix + our_key] = hf_state[hf_prefix + hf_key]
        if symbol == ATTENTION:
            ours[our_prefix + _QKV_OURS] = torch.cat([hf_state[hf_prefix + k] for k in _QKV_HF])
    return ours


def hybrid_to_nemotron_h_state_dict(our_state: dict, config: TransformerConfig, pattern: str, vocab_size: int,
                                    tie_word_embeddings: bool = False) -> dict:
    """The HF NemotronH state dict of a single-process HybridModel's state dict (padding dropped)."""
    layers = parse_hybrid_pattern(pattern).layers
    embedding = our_state["embedding.word_embeddings.weight"][:vocab_size]
    hf = {"model.embeddings.weight": embedding, "model.norm_f.weight": our_state["decoder.final_norm.weight"],
          "lm_head.weight": embedding if tie_word_embeddings else our_state["output_layer.weight"][:vocab_size]}
    q_size = config.num_attention_heads * config.kv_channels
    kv_size = config.num_query_groups * config.kv_channels
    for i, symbol in enumerate(layers):
        hf_prefix, our_prefix = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_key, our_key in _RENAMES[symbol]:
            hf[hf_prefix + hf_key] = our_state[our_prefix + our_key]
        if symbol == ATTENTION:
            q, k, v = our_state[our_prefix + _QKV_OURS].split([q_size, kv_size, kv_size])
            hf.update(zip((hf_prefix + key for key in _QKV_HF), (q, k, v)))
    return hf
