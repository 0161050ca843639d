"""HuggingFace <-> our state dicts and configs, one set of functions per model family.

Our side is the full (unsharded, TP1/PP1) state dict of a GPTModel: the vocabulary rows are
padded with zeros to ``pad_vocab_size(vocab_size, 1)``, QKV is packed [Q; K; V] and a gated
MLP's fc1 is packed [gate; up]. Each family describes its weights as :class:`Rule` s (one of
our keys <- one or more HF keys concatenated on dim 0, optionally transposed), and the same
rules drive both directions, so a round trip is bit-identical.

Functions per family (``llama``, ``gpt2``; others are appended the same way):
``<family>_config_from_hf(hf_config, **overrides) -> (TransformerConfig, gpt_model_kwargs)``,
``<family>_state_dict_from_hf(hf_state_dict, config) -> ours`` and
``<family>_state_dict_to_hf(state_dict, config, vocab_size) -> HF``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core.config import TransformerConfig
from megatron.core.tensor_parallel import pad_vocab_size
from megatron.core.transformer.mlp import gelu_tanh


class HFMappingError(ValueError):
    """An HF config or state dict that this mapping cannot represent exactly."""


@dataclass(frozen=True)
class Rule:
    """``ours`` = concat over dim 0 of ``hf`` keys (each transposed first when ``transpose``,
    for GPT-2's Conv1D); ``vocab`` rows are zero-padded to the padded vocabulary on our side."""

    ours: str
    hf: tuple[str, ...]
    transpose: bool = False
    vocab: bool = False
    sizes: tuple[int, ...] | None = None  # rows of each HF key when several are packed

    def __post_init__(self):
        if len(self.hf) > 1 and (self.sizes is None or len(self.sizes) != len(self.hf)):
            raise HFMappingError(f"rule for {self.ours!r} packs {len(self.hf)} HF keys and needs their sizes")


def _apply_from_hf(rules: list[Rule], hf_state_dict: dict) -> dict:
    missing = sorted(k for rule in rules for k in rule.hf if k not in hf_state_dict)
    if missing:
        raise HFMappingError(f"HF state dict lacks {len(missing)} expected keys, e.g. {missing[:3]}")
    mapped = {k for rule in rules for k in rule.hf}
    unused = sorted(k for k in hf_state_dict if k not in mapped)
    if unused:
        raise HFMappingError(f"HF state dict has {len(unused)} keys this mapping does not know, e.g. {unused[:3]}")
    out = {}
    for rule in rules:
        parts = [hf_state_dict[k].t() if rule.transpose else hf_state_dict[k] for k in rule.hf]
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        if rule.vocab:
            padded = pad_vocab_size(tensor.shape[0], 1)
            tensor = torch.cat([tensor, tensor.new_zeros((padded - tensor.shape[0],) + tuple(tensor.shape[1:]))])
        out[rule.ours] = tensor.contiguous().clone()
    return out


def _apply_to_hf(rules: list[Rule], state_dict: dict, vocab_size: int) -> dict:
    out = {}
    for rule in rules:
        if rule.ours not in state_dict:
            raise HFMappingError(f"our state dict lacks {rule.ours!r}")
        tensor = state_dict[rule.ours]
        if rule.vocab:
            tensor = tensor[:vocab_size]
        parts = tensor.split(list(rule.sizes), dim=0) if rule.sizes else (tensor,)
        if rule.sizes and sum(rule.sizes) != tensor.shape[0]:
            raise HFMappingError(f"{rule.ours!r} has {tensor.shape[0]} rows, the HF keys {rule.hf} need {sum(rule.sizes)}")
        for key, part in zip(rule.hf, parts):
            out[key] = (part.t() if rule.transpose else part).contiguous().clone()
    return out


# ---------------------------------------------------------------- Llama (LlamaForCausalLM)

LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama_rope(hf_config) -> tuple[float, bool, float]:
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = {"rope_theta": getattr(hf_config, "rope_theta", 10000.0), **(getattr(hf_config, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(params["rope_theta"]), False, 8.0
    if rope_type == "llama3":
        differing = {k: params.get(k) for k, v in LLAMA3_ROPE_DEFAULTS.items() if params.get(k) != v}
        if differing:
            raise HFMappingError(f"llama3 rope scaling supports only {LLAMA3_ROPE_DEFAULTS}; got {differing}")
        return float(params["rope_theta"]), True, float(params["factor"])
    raise HFMappingError(f"rope_type {rope_type!r} is not supported; supported: 'default', 'llama3'")


def llama_config_from_hf(hf_config, **overrides) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and GPTModel keyword arguments equivalent to a LlamaConfig."""
    if hf_config.hidden_act != "silu":
        raise HFMappingError(f"Llama hidden_act must be 'silu' (SwiGLU), got {hf_config.hidden_act!r}")
    attention_bias, mlp_bias = bool(hf_config.attention_bias), bool(getattr(hf_config, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HFMappingError(
            f"attention_bias ({attention_bias}) and mlp_bias ({mlp_bias}) must agree (one add_bias_linear switch)"
        )
    rotary_base, rope_scaling, rope_scaling_factor = _llama_rope(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    config = TransformerConfig(**{
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_query_groups": hf_config.num_key_value_heads or hf_config.num_attention_heads,
        "ffn_hidden_size": hf_config.intermediate_size,
        "kv_channels": head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": attention_bias,
        "attention_dropout": hf_config.attention_dropout,
        "init_method_std": hf_config.initializer_range,
        **overrides,
    })
    kwargs = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": rotary_base,
        "rope_scaling": rope_scaling,
        "rope_scaling_factor": rope_scaling_factor,
        "share_embeddings_and_output_weights": bool(hf_config.tie_word_embeddings),
    }
    return config, kwargs


def _llama_rules(config: TransformerConfig) -> list[Rule]:
    bias = ("weight", "bias") if config.add_bias_linear else ("weight",)
    q, kv, ffn = (config.num_attention_heads * config.kv_channels, config.num_query_groups * config.kv_channels,
                  config.ffn_hidden_size)
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab=True)]
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules.append(Rule(ours + "input_layernorm.weight", (hf + "input_layernorm.weight",)))
        rules.append(Rule(ours + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)))
        for kind in bias:
            rules += [
                Rule(ours + f"self_attention.linear_qkv.{kind}",
                     tuple(hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"), sizes=(q, kv, kv)),
                Rule(ours + f"self_attention.linear_proj.{kind}", (hf + f"self_attn.o_proj.{kind}",)),
                Rule(ours + f"mlp.linear_fc1.{kind}", (hf + f"mlp.gate_proj.{kind}", hf + f"mlp.up_proj.{kind}"),
                     sizes=(ffn, ffn)),
                Rule(ours + f"mlp.linear_fc2.{kind}", (hf + f"mlp.down_proj.{kind}",)),
            ]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


def _fill_tied_lm_head(hf_state_dict: dict, embed_key: str, tied: bool) -> dict:
    """Tied HF checkpoints may omit ``lm_head.weight``; it is the input embedding then."""
    if tied and "lm_head.weight" not in hf_state_dict:
        return {**hf_state_dict, "lm_head.weight": hf_state_dict[embed_key]}
    return hf_state_dict


def llama_state_dict_from_hf(hf_state_dict: dict, config: TransformerConfig, tied: bool = False) -> dict:
    """Our full state dict from a LlamaForCausalLM state dict."""
    return _apply_from_hf(_llama_rules(config), _fill_tied_lm_head(hf_state_dict, "model.embed_tokens.weight", tied))


def llama_state_dict_to_hf(state_dict: dict, config: TransformerConfig, vocab_size: int) -> dict:
    """A LlamaForCausalLM state dict from our full state dict (vocabulary padding dropped)."""
    return _apply_to_hf(_llama_rules(config), state_dict, vocab_size)


# ---------------------------------------------------------------- GPT-2 (GPT2LMHeadModel)

GPT2_ACTIVATIONS = {"gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu}


def gpt2_config_from_hf(hf_config, **overrides) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and GPTModel keyword arguments equivalent to a GPT2Config."""
    if hf_config.activation_function not in GPT2_ACTIVATIONS:
        raise HFMappingError(
            f"GPT-2 activation_function {hf_config.activation_function!r} is not supported; "
            f"supported: {sorted(GPT2_ACTIVATIONS)}"
        )
    unsupported = {
        "scale_attn_weights": (hf_config.scale_attn_weights, True),
        "scale_attn_by_inverse_layer_idx": (hf_config.scale_attn_by_inverse_layer_idx, False),
        "add_cross_attention": (getattr(hf_config, "add_cross_attention", False), False),
    }
    wrong = {k: got for k, (got, want) in unsupported.items() if bool(got) != want}
    if wrong:
        raise HFMappingError(f"GPT-2 settings not supported: {wrong}; supported values: "
                             f"{ {k: want for k, (_, want) in unsupported.items()} }")
    config = TransformerConfig(**{
        "num_layers": hf_config.n_layer,
        "hidden_size": hf_config.n_embd,
        "num_attention_heads": hf_config.n_head,
        "ffn_hidden_size": hf_config.n_inner or 4 * hf_config.n_embd,
        "normalization": "LayerNorm",
        "layernorm_epsilon": hf_config.layer_norm_epsilon,
        "activation_func": GPT2_ACTIVATIONS[hf_config.activation_function],
        "add_bias_linear": True,
        "hidden_dropout": hf_config.resid_pdrop,
        "attention_dropout": hf_config.attn_pdrop,
        "init_method_std": hf_config.initializer_range,
        **overrides,
    })
    kwargs = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.n_positions,
        "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": bool(getattr(hf_config, "tie_word_embeddings", True)),
    }
    return config, kwargs


def _gpt2_rules(config: TransformerConfig) -> list[Rule]:
    rules = [
        Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), vocab=True),
        Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
    ]
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            conv1d = kind == "weight"
            rules += [
                Rule(ours + f"input_layernorm.{kind}", (hf + f"ln_1.{kind}",)),
                Rule(ours + f"self_attention.linear_qkv.{kind}", (hf + f"attn.c_attn.{kind}",), transpose=conv1d),
                Rule(ours + f"self_attention.linear_proj.{kind}", (hf + f"attn.c_proj.{kind}",), transpose=conv1d),
                Rule(ours + f"pre_mlp_layernorm.{kind}", (hf + f"ln_2.{kind}",)),
                Rule(ours + f"mlp.linear_fc1.{kind}", (hf + f"mlp.c_fc.{kind}",), transpose=conv1d),
                Rule(ours + f"mlp.linear_fc2.{kind}", (hf + f"mlp.c_proj.{kind}",), transpose=conv1d),
            ]
    rules += [
        Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
        Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
        Rule("output_layer.weight", ("lm_head.weight",), vocab=True),
    ]
    return rules


def gpt2_state_dict_from_hf(hf_state_dict: dict, config: TransformerConfig, tied: bool = True) -> dict:
    """Our full state dict from a GPT2LMHeadModel state dict (Conv1D weights transposed)."""
    return _apply_from_hf(_gpt2_rules(config), _fill_tied_lm_head(hf_state_dict, "transformer.wte.weight", tied))


def gpt2_state_dict_to_hf(state_dict: dict, config: TransformerConfig, vocab_size: int) -> dict:
    """A GPT2LMHeadModel state dict from our full state dict."""
    return _apply_to_hf(_gpt2_rules(config), state_dict, vocab_size)
