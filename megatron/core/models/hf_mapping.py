"""HuggingFace <-> our state dicts and configs, one set of functions per model family.

Our side is the full (unsharded, TP1/PP1) state dict of a GPTModel: the vocabulary rows are
padded with zeros to ``pad_vocab_size(vocab_size, 1)``, QKV is packed [Q; K; V] and a gated
MLP's fc1 is packed [gate; up]. Each family describes its weights as :class:`Rule` s (one of
our keys <- one or more HF keys concatenated on dim 0, optionally transposed), and the same
rules drive both directions, so a round trip is bit-identical.

Functions per family (``llama``, ``mixtral``, ``qwen3_moe``, ``gpt2``, ``deepseek_v3``, ``nemotron_h``; others
are appended the same way):
``<family>_config_from_hf(hf_config, **overrides) -> (TransformerConfig, gpt_model_kwargs)``,
``<family>_state_dict_from_hf(hf_state_dict, config) -> ours`` and
``<family>_state_dict_to_hf(state_dict, config, vocab_size) -> HF``, and for checkpoints trained
here (no HF config recorded) ``<family>_config_to_hf(record) -> HF config keyword arguments``,
which refuses what the HF architecture cannot represent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core.activations import gelu_tanh, squared_relu
from megatron.core.config import TransformerConfig
from megatron.core.errors import MegatronInputError
from megatron.core.tensor_parallel import pad_vocab_size
from megatron.core.transformer.rope import yarn_concentration, yarn_mscale


class HFMappingError(MegatronInputError):
    """An HF config or state dict that this mapping cannot represent exactly."""


def _refuse(message: str, checks: list[tuple[bool, str]]) -> None:
    """Raise one :class:`HFMappingError` ``"message: what; what"`` naming every ``(bad, what)``
    check that is bad."""
    problems = [what for bad, what in checks if bad]
    if problems:
        raise HFMappingError(f"{message}: " + "; ".join(problems))


def _require_exportable(architecture: str, problems: list[tuple[bool, str]]) -> None:
    _refuse(f"this model cannot be exported as {architecture}", problems)


def _kv_channels(config: TransformerConfig) -> int:
    return config.kv_channels or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Rule:
    """``ours`` = concat over dim 0 of ``hf`` keys (each with its last two dims swapped first when
    ``transpose``: GPT-2's Conv1D, stacked expert weights); ``vocab`` rows are zero-padded to
    the padded vocabulary on our side."""

    ours: str
    hf: tuple[str, ...]
    transpose: bool = False
    vocab: bool = False
    sizes: tuple[int, ...] | None = None  # rows of each HF key when several are packed

    def __post_init__(self):
        if len(self.hf) > 1 and (self.sizes is None or len(self.sizes) != len(self.hf)):
            raise HFMappingError(f"rule for {self.ours!r} packs {len(self.hf)} HF keys and needs their sizes")


class MappedStateDict(Mapping):
    """Our state dict from an HF one by ``rules``, made one key at a time on access: with a lazy
    ``hf_state_dict`` (e.g. :class:`SafetensorsStateDict`) only the HF tensors of the key being
    read are in memory, and :meth:`rows` reads only those of the rows asked for (one part of a
    packed QKV). Key sets are checked up front; :meth:`shape` reads no tensor."""

    def __init__(self, rules: list[Rule], hf_state_dict: Mapping):
        missing = sorted(k for rule in rules for k in rule.hf if k not in hf_state_dict)
        if missing:
            raise HFMappingError(f"HF state dict lacks {len(missing)} expected keys, e.g. {missing[:3]}")
        mapped = {k for rule in rules for k in rule.hf}
        unused = sorted(k for k in hf_state_dict if k not in mapped)
        if unused:
            raise HFMappingError(f"HF state dict has {len(unused)} keys this mapping does not know, e.g. {unused[:3]}")
        self._rules = {rule.ours: rule for rule in rules}
        self._hf = hf_state_dict

    def _part_shapes(self, rule: Rule) -> list[tuple[int, ...]]:
        shapes = [tensor_shape(self._hf, k) for k in rule.hf]
        return [(*s[:-2], s[-1], s[-2]) for s in shapes] if rule.transpose else shapes  # last two dims swap

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``self[key]``, from the HF tensors' shapes."""
        rule = self._rules[key]
        shapes = self._part_shapes(rule)
        rows = sum(s[0] for s in shapes)
        return (pad_vocab_size(rows, 1) if rule.vocab else rows,) + tuple(shapes[0][1:])

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``self[key]``, contiguous, reading only the HF tensors that
        hold them (it may share memory with them)."""
        rule = self._rules[key]
        parts, first = [], 0
        for hf_key, shape in zip(rule.hf, self._part_shapes(rule), strict=True):
            lo, hi = max(start, first), min(stop, first + shape[0])
            if lo < hi:
                tensor = self._hf[hf_key].transpose(-2, -1) if rule.transpose else self._hf[hf_key]
                parts.append(tensor[lo - first : hi - first])
            first += shape[0]
        padding = stop - max(start, first)
        if padding > 0:  # vocabulary rows past the HF ones are zeros
            like = parts[0] if parts else self._hf[rule.hf[-1]]
            parts.append(like.new_zeros((padding,) + tuple(like.shape[1:])))
        return (torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]).contiguous()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.rows(key, 0, self.shape(key)[0]).clone()

    def __contains__(self, key) -> bool:
        return key in self._rules

    def __iter__(self):
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)


def tensor_shape(state_dict: Mapping, key: str) -> tuple[int, ...]:
    """The shape of ``state_dict[key]``, without reading the tensor when the mapping can tell
    (it has a ``shape(key)`` method, as the lazy ones here do)."""
    shape = getattr(state_dict, "shape", None)
    return tuple(shape(key)) if callable(shape) else tuple(state_dict[key].shape)


class SafetensorsStateDict(Mapping):
    """The tensors of an HF directory's ``*.safetensors`` files (sharded or not), each read from
    disk only when asked for (``safetensors.safe_open``), never the whole model at once. Keys are
    the HF module's; ``disk_prefixes`` maps prefixes transformers writes to disk instead (e.g.
    NemotronH's ``backbone.`` for the module's ``model.``)."""

    def __init__(self, directory: str, disk_prefixes: dict[str, str] | None = None):
        import glob
        import os

        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise HFMappingError(f"{directory} has no *.safetensors files (save_pretrained writes them)")
        from safetensors import safe_open

        self._stored = {}  # module key -> (file, key on disk)
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    module_key = key
                    for disk, module in (disk_prefixes or {}).items():
                        if key.startswith(disk):
                            module_key = module + key[len(disk) :]
                    self._stored[module_key] = (path, key)

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path, stored_key = self._stored[key]
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(stored_key)

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``self[key]``, from the file's header (no tensor is read)."""
        from safetensors import safe_open

        path, stored_key = self._stored[key]
        with safe_open(path, framework="pt") as f:
            return tuple(f.get_slice(stored_key).get_shape())

    def __contains__(self, key) -> bool:  # Mapping's default would read the tensor
        return key in self._stored

    def __iter__(self):
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


class _WithTiedHead(Mapping):
    """``hf_state_dict`` plus ``lm_head.weight`` read as the input embedding (lazily)."""

    def __init__(self, hf_state_dict: Mapping, embed_key: str):
        self._hf, self._embed_key = hf_state_dict, embed_key

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._hf[self._embed_key if key == "lm_head.weight" else key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tensor_shape(self._hf, self._embed_key if key == "lm_head.weight" else key)

    def __contains__(self, key) -> bool:
        return key == "lm_head.weight" or key in self._hf

    def __iter__(self):
        yield from self._hf
        yield "lm_head.weight"

    def __len__(self) -> int:
        return len(self._hf) + 1


class StackedExperts(Mapping):
    """``hf_state_dict`` with the stacked expert tensors of transformers' MoE modules
    (``{layer}.mlp.experts.gate_up_proj [E, 2f, h]``, ``.experts.down_proj [E, h, f]``,
    ``.mlp.gate.weight``) made from the per-expert tensors that checkpoints store (the Hub layout
    ``save_pretrained`` writes), each stacked only when asked for. ``disk_block`` is the MoE
    block's name on disk (Mixtral: ``block_sparse_moe``), ``names`` the per-expert gate, up and
    down projections. A state dict already stacked passes through."""

    def __init__(self, hf_state_dict: Mapping, num_layers: int, num_experts: int, disk_block: str, names):
        self._hf, self._made, hidden = hf_state_dict, {}, set()
        for i in range(num_layers):
            disk, module = f"model.layers.{i}.{disk_block}.", f"model.layers.{i}.mlp."
            gate, up, down = ([f"{disk}experts.{e}.{name}.weight" for e in range(num_experts)] for name in names)
            if not gate or gate[0] not in hf_state_dict:  # a dense layer (or no experts at all)
                continue
            self._made[module + "experts.gate_up_proj"] = (gate, up)
            self._made[module + "experts.down_proj"] = (down,)
            self._made[module + "gate.weight"] = (disk + "gate.weight",)
            hidden.update(gate + up + down + [disk + "gate.weight"])
        self._passed = [key for key in hf_state_dict if key not in hidden]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._made:
            return self._hf[key]
        parts = self._made[key]
        if isinstance(parts[0], str):
            return self._hf[parts[0]]
        per_expert = [torch.cat([self._hf[part[e]] for part in parts], dim=0) for e in range(len(parts[0]))]
        return torch.stack(per_expert)

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._made:
            return tensor_shape(self._hf, key)
        parts = self._made[key]
        if isinstance(parts[0], str):
            return tensor_shape(self._hf, parts[0])
        first = [tensor_shape(self._hf, part[0]) for part in parts]
        return (len(parts[0]), sum(shape[0] for shape in first), *first[0][1:])

    def __contains__(self, key) -> bool:
        return key in self._made or key in self._passed

    def __iter__(self):
        yield from self._passed
        yield from self._made

    def __len__(self) -> int:
        return len(self._passed) + len(self._made)


def _apply_from_hf(rules: list[Rule], hf_state_dict: Mapping) -> MappedStateDict:
    return MappedStateDict(rules, hf_state_dict)


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
            raise HFMappingError(
                f"{rule.ours!r} has {tensor.shape[0]} rows, the HF keys {rule.hf} need {sum(rule.sizes)}"
            )
        for key, part in zip(rule.hf, parts, strict=True):
            out[key] = (part.transpose(-2, -1) if rule.transpose else part).contiguous().clone()
    return out


def _swiglu_rules(ours: str, hf: str, width: int, kind: str = "weight") -> list[Rule]:
    """A SwiGLU MLP's ``kind`` (weight or bias): our packed ``linear_fc1`` [gate; up] and
    ``linear_fc2`` <- HF's gate/up/down projections."""
    return [
        Rule(ours + f"linear_fc1.{kind}", (hf + f"gate_proj.{kind}", hf + f"up_proj.{kind}"), sizes=(width, width)),
        Rule(ours + f"linear_fc2.{kind}", (hf + f"down_proj.{kind}",)),
    ]


# ---------------------------------------------------------------- Llama (LlamaForCausalLM)

LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _hf_rope(hf_config, mla: bool = False) -> tuple[dict, dict]:
    """(GPTModel keyword arguments, TransformerConfig fields) of an HF config's RoPE: default,
    Llama-3 scaling or YaRN (whose attention factor, given or inferred the way HF infers it,
    becomes the equal ``yarn_mscale`` / ``yarn_mscale_all_dim``). ``mla``: HF's multi-latent
    attention also scales the softmax by ``mscale_all_dim`` whenever it is set, so that is kept
    and ``yarn_mscale`` solved for the attention factor."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = {
            "rope_theta": getattr(hf_config, "rope_theta", 10000.0),
            **(getattr(hf_config, "rope_scaling", None) or {}),
        }
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = {"rotary_base": float(params["rope_theta"]), "position_embedding_type": "rope"}
    if rope_type == "default":
        return base, {}
    if rope_type == "llama3":
        differing = {k: params.get(k) for k, v in LLAMA3_ROPE_DEFAULTS.items() if params.get(k) != v}
        if differing:
            raise HFMappingError(f"llama3 rope scaling supports only {LLAMA3_ROPE_DEFAULTS}; got {differing}")
        return {**base, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}, {}
    if rope_type != "yarn":
        raise HFMappingError(f"rope_type {rope_type!r} is not supported; supported: 'default', 'llama3', 'yarn'")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFMappingError("yarn rope scaling is supported on whole heads only (partial_rotary_factor 1.0)")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is not None or not (mscale and mscale_all_dim):
        if attention_factor is None:
            attention_factor = yarn_mscale(factor)
        if factor <= 1 and attention_factor != 1.0:
            raise HFMappingError(f"yarn attention_factor {attention_factor} needs factor > 1, got {factor}")
        mscale_all_dim = float(mscale_all_dim or 0.0) if mla else 0.0
        scaled = attention_factor * yarn_mscale(factor, mscale_all_dim)  # = yarn_mscale(factor, mscale)
        mscale = (scaled - 1) / (0.1 * math.log(factor)) if factor > 1 else 1.0
    fields = {
        "yarn_rotary_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": int(original),
        "yarn_beta_fast": float(params.get("beta_fast") or 32),
        "yarn_beta_slow": float(params.get("beta_slow") or 1),
        "yarn_mscale": float(mscale),
        "yarn_mscale_all_dim": float(mscale_all_dim),
        "yarn_correction_range_round_to_int": bool(params.get("truncate", True)),
    }
    return {**base, "position_embedding_type": "yarn"}, fields


def _yarn_rope_parameters(config: TransformerConfig) -> dict:
    """HF ``rope_parameters`` of a config's YaRN RoPE, less how its attention factor is said
    (each architecture says it its own way)."""
    return {
        "rope_type": "yarn",
        "factor": config.yarn_rotary_scaling_factor,
        "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
        "beta_fast": config.yarn_beta_fast,
        "beta_slow": config.yarn_beta_slow,
        "truncate": config.yarn_correction_range_round_to_int,
    }


def llama_config_from_hf(hf_config, **overrides) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and GPTModel keyword arguments equivalent to a LlamaConfig."""
    if hf_config.hidden_act != "silu":
        raise HFMappingError(f"Llama hidden_act must be 'silu' (SwiGLU), got {hf_config.hidden_act!r}")
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HFMappingError(
            f"attention_bias ({attention_bias}) and mlp_bias ({mlp_bias}) must agree (one add_bias_linear switch)"
        )
    rope, rope_fields = _hf_rope(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    config = TransformerConfig(
        **{
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
            **rope_fields,
            **overrides,
        }
    )
    kwargs = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "rope_scaling": False,
        "rope_scaling_factor": 8.0,
        **rope,
        "share_embeddings_and_output_weights": bool(hf_config.tie_word_embeddings),
    }
    return config, kwargs


def llama_config_to_hf(record) -> dict:
    """LlamaConfig keyword arguments for a GPT ``record`` with RMSNorm, SwiGLU and RoPE."""
    config = record.config
    _require_exportable(
        "LlamaForCausalLM",
        [
            (config.normalization != "RMSNorm", f"normalization {config.normalization!r} (Llama uses RMSNorm)"),
            (
                not config.gated_linear_unit or config.activation_func is not F.silu,
                "an MLP other than SwiGLU (needs --swiglu)",
            ),
            (
                record.position_embedding_type not in ("rope", "yarn"),
                f"position embeddings {record.position_embedding_type!r}",
            ),
            (record.rotary_percent != 1.0, f"rotary_percent {record.rotary_percent} (Llama rotates whole heads)"),
            (config.rotary_interleaved, "interleaved RoPE (Llama rotates the two halves of each head)"),
            (
                config.add_qkv_bias and not config.add_bias_linear,
                "a QKV bias without other linear biases (Llama's attention_bias covers all attention linears)",
            ),
            (bool(config.mtp_num_layers), "multi-token prediction layers"),
            (bool(config.num_moe_experts), "MoE layers (export as Mixtral or Qwen3-MoE)"),
            (config.qk_layernorm, "per-head query/key norms"),
        ],
    )
    rope = {"rope_type": "default", "rope_theta": float(record.rotary_base)}
    if record.rope_scaling:
        rope = {**rope, "rope_type": "llama3", "factor": record.rope_scaling_factor, **LLAMA3_ROPE_DEFAULTS}
    if record.position_embedding_type == "yarn":
        rope = {**rope, **_yarn_rope_parameters(config), "attention_factor": yarn_concentration(config)}
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": record.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups or config.num_attention_heads,
        "head_dim": _kv_channels(config),
        "max_position_embeddings": record.max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "hidden_act": "silu",
        "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": record.share_embeddings_and_output_weights,
        "rope_parameters": rope,
    }


def _llama_rules(config: TransformerConfig) -> list[Rule]:
    bias = ("weight", "bias") if config.add_bias_linear else ("weight",)
    q, kv, ffn = (
        config.num_attention_heads * config.kv_channels,
        config.num_query_groups * config.kv_channels,
        config.ffn_hidden_size,
    )
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab=True)]
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules.append(Rule(ours + "input_layernorm.weight", (hf + "input_layernorm.weight",)))
        rules.append(Rule(ours + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)))
        for kind in bias:
            rules += [
                Rule(
                    ours + f"self_attention.linear_qkv.{kind}",
                    tuple(hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"),
                    sizes=(q, kv, kv),
                ),
                Rule(ours + f"self_attention.linear_proj.{kind}", (hf + f"self_attn.o_proj.{kind}",)),
                *_swiglu_rules(ours + "mlp.", hf + "mlp.", ffn, kind),
            ]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


def _fill_tied_lm_head(hf_state_dict: Mapping, embed_key: str, tied: bool) -> Mapping:
    """Tied HF checkpoints may omit ``lm_head.weight``; it is the input embedding then."""
    if tied and "lm_head.weight" not in hf_state_dict:
        return _WithTiedHead(hf_state_dict, embed_key)
    return hf_state_dict


def llama_state_dict_from_hf(hf_state_dict: dict, config: TransformerConfig, tied: bool = False) -> Mapping:
    """Our full state dict (made key by key on access) from a LlamaForCausalLM state dict."""
    return _apply_from_hf(_llama_rules(config), _fill_tied_lm_head(hf_state_dict, "model.embed_tokens.weight", tied))


def llama_state_dict_to_hf(state_dict: dict, config: TransformerConfig, vocab_size: int) -> dict:
    """A LlamaForCausalLM state dict from our full state dict (vocabulary padding dropped)."""
    return _apply_to_hf(_llama_rules(config), state_dict, vocab_size)


# ---------------------------------------------------------------- Mixtral (MixtralForCausalLM)


def mixtral_config_from_hf(hf_config, **overrides) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and GPTModel keyword arguments equivalent to a MixtralConfig: Llama
    with every MLP an MoE of ``num_local_experts`` SwiGLU experts, top-k over the softmax of the
    router logits with the k weights renormalized (= softmax over the top-k logits, our default)."""
    unsupported = [
        (getattr(hf_config, "sliding_window", None) is not None, "sliding-window attention (sliding_window)"),
        (hf_config.router_jitter_noise, "router jitter noise (router_jitter_noise must be 0)"),
    ]
    _refuse("Mixtral settings not supported", unsupported)
    moe = {
        "num_moe_experts": hf_config.num_local_experts,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_ffn_hidden_size": hf_config.intermediate_size,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf_config.router_aux_loss_coef),
    }
    return llama_config_from_hf(hf_config, **{**moe, **overrides})


def _moe_llama_config_to_hf(record, architecture: str, extra_problems: list[tuple[bool, str]]) -> dict:
    """The Llama keyword arguments plus the MoE ones shared by Mixtral and Qwen3-MoE."""
    config = record.config
    dense = record.replace(
        config=dataclasses.replace(config, num_moe_experts=None, moe_layer_freq=1, qk_layernorm=False)
    )
    _require_exportable(
        architecture,
        [
            (not config.num_moe_experts, "no MoE layers"),
            (config.moe_router_score_function != "softmax", f"{config.moe_router_score_function} router scores"),
            (config.moe_shared_expert_intermediate_size is not None, "shared experts"),
            (config.moe_router_enable_expert_bias, "an expert bias"),
            (config.moe_router_num_groups is not None, "group-limited routing"),
            (config.moe_router_topk_scaling_factor is not None, "scaled routing weights"),
            (config.moe_expert_capacity_factor is not None, "token dropping (capacity factor)"),
            (config.add_bias_linear, "linear biases"),
            (config.moe_layer_freq != 1, f"dense layers among the MoE ones (moe_layer_freq {config.moe_layer_freq})"),
            *extra_problems,
        ],
    )
    kwargs = llama_config_to_hf(dense)
    for key in ("mlp_bias", "intermediate_size"):
        kwargs.pop(key)
    return {
        **kwargs,
        "architectures": [architecture],
        "num_local_experts": config.num_moe_experts,
        "num_experts_per_tok": config.moe_router_topk,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
    }


def mixtral_config_to_hf(record) -> dict:
    """MixtralConfig keyword arguments for a GPT ``record`` with SwiGLU MoE layers (softmax over
    the top-k logits) and no per-head query/key norms."""
    config = record.config
    kwargs = _moe_llama_config_to_hf(
        record,
        "MixtralForCausalLM",
        [
            (config.qk_layernorm, "per-head query/key norms (export as Qwen3-MoE)"),
            (config.moe_router_pre_softmax, "unnormalized top-k weights (export as Qwen3-MoE)"),
        ],
    )
    return {**kwargs, "intermediate_size": config.moe_ffn_hidden_size, "router_jitter_noise": 0.0}


def _mixtral_rules(config: TransformerConfig) -> list[Rule]:
    rules = []
    for rule in _llama_rules(config):
        if ".mlp." not in rule.ours:
            rules.append(rule)
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules += [
            Rule(ours + "mlp.router.weight", (hf + "mlp.gate.weight",)),
            Rule(ours + "mlp.experts.weight1", (hf + "mlp.experts.gate_up_proj",), transpose=True),
            Rule(ours + "mlp.experts.weight2", (hf + "mlp.experts.down_proj",), transpose=True),
        ]
        if config.qk_layernorm:
            rules += [
                Rule(ours + f"self_attention.{p}_layernorm.weight", (hf + f"self_attn.{p}_norm.weight",)) for p in "qk"
            ]
    return rules


HF_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # an expert's projections on disk (Qwen3-MoE, DeepSeek-V3)


def _moe_state_dict_from_hf(hf_state_dict, config, tied, disk_block, names, rules) -> Mapping:
    """Our state dict by ``rules`` from an HF one whose experts may be stored per expert on disk
    (``disk_block``'s ``experts.{e}.{name}`` for the gate, up and down ``names``)."""
    stacked = StackedExperts(hf_state_dict, config.num_layers, config.num_moe_experts or 0, disk_block, names)
    return _apply_from_hf(rules, _fill_tied_lm_head(stacked, "model.embed_tokens.weight", tied))


def mixtral_state_dict_from_hf(hf_state_dict: dict, config: TransformerConfig, tied: bool = False) -> Mapping:
    """Our full state dict (made key by key on access) from a MixtralForCausalLM state dict:
    transformers' stacked expert tensors, or the per-expert ``block_sparse_moe.experts.{e}.w1/w3/w2``
    of a checkpoint on disk."""
    return _moe_state_dict_from_hf(
        hf_state_dict, config, tied, "block_sparse_moe", ("w1", "w3", "w2"), _mixtral_rules(config)
    )


def mixtral_state_dict_to_hf(state_dict: dict, config: TransformerConfig, vocab_size: int) -> dict:
    """A MixtralForCausalLM state dict from our full state dict."""
    return _apply_to_hf(_mixtral_rules(config), state_dict, vocab_size)


# ---------------------------------------------------------------- Qwen3-MoE (Qwen3MoeForCausalLM)


def qwen3_moe_config_from_hf(hf_config, **overrides) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and GPTModel keyword arguments equivalent to a Qwen3MoeConfig: Mixtral's
    layout plus per-head RMSNorms of queries and keys (q_norm / k_norm) and an explicit head size;
    ``norm_topk_prob=False`` keeps the top-k softmax probabilities over all experts unnormalized
    (our ``moe_router_pre_softmax``), ``True`` renormalizes them (softmax over the top-k logits)."""
    unsupported = [
        (bool(getattr(hf_config, "use_sliding_window", False)), "sliding-window attention (use_sliding_window)"),
        (hf_config.decoder_sparse_step != 1, "dense layers between MoE layers (decoder_sparse_step must be 1)"),
        (bool(hf_config.mlp_only_layers), "dense layers (mlp_only_layers must be empty)"),
    ]
    _refuse("Qwen3-MoE settings not supported", unsupported)
    moe = {
        "num_moe_experts": hf_config.num_experts,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_router_pre_softmax": not hf_config.norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf_config.router_aux_loss_coef),
        "qk_layernorm": True,
    }
    return llama_config_from_hf(hf_config, **{**moe, **overrides})


def qwen3_moe_config_to_hf(record) -> dict:
    """Qwen3MoeConfig keyword arguments for a GPT ``record`` with SwiGLU MoE layers and per-head
    RMSNorms of queries and keys."""
    config = record.config
    kwargs = _moe_llama_config_to_hf(
        record, "Qwen3MoeForCausalLM", [(not config.qk_layernorm, "no per-head query/key norms (needs --qk-layernorm)")]
    )
    kwargs.pop("num_local_experts")
    return {
        **kwargs,
        "num_experts": config.num_moe_experts,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "norm_topk_prob": not config.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def qwen3_moe_state_dict_from_hf(hf_state_dict: dict, config: TransformerConfig, tied: bool = False) -> Mapping:
    """Our full state dict (made key by key on access) from a Qwen3MoeForCausalLM state dict:
    stacked expert tensors, or the per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` of
    a checkpoint on disk."""
    return _moe_state_dict_from_hf(hf_state_dict, config, tied, "mlp", HF_EXPERT_NAMES, _mixtral_rules(config))


def qwen3_moe_state_dict_to_hf(state_dict: dict, config: TransformerConfig, vocab_size: int) -> dict:
    """A Qwen3MoeForCausalLM state dict from our full state dict."""
    return mixtral_state_dict_to_hf(state_dict, config, vocab_size)


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
        raise HFMappingError(
            f"GPT-2 settings not supported: {wrong}; supported values: "
            f"{ {k: want for k, (_, want) in unsupported.items()} }"
        )
    config = TransformerConfig(
        **{
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
        }
    )
    kwargs = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.n_positions,
        "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": bool(getattr(hf_config, "tie_word_embeddings", True)),
    }
    return config, kwargs


def gpt2_config_to_hf(record) -> dict:
    """GPT2Config keyword arguments for a GPT ``record`` with LayerNorm, biases, a GELU MLP and
    learned absolute positions."""
    config = record.config
    activation = {gelu_tanh: "gelu_new", F.gelu: "gelu"}.get(config.activation_func)
    _require_exportable(
        "GPT2LMHeadModel",
        [
            (config.normalization != "LayerNorm", f"normalization {config.normalization!r} (GPT-2 uses LayerNorm)"),
            (config.gated_linear_unit or activation is None, "an MLP other than GELU (GPT-2 has no gated MLP)"),
            (not config.add_bias_linear, "linear layers without biases (GPT-2 has biases everywhere)"),
            (
                record.position_embedding_type != "learned_absolute",
                f"position embeddings {record.position_embedding_type!r} (GPT-2 learns absolute positions)",
            ),
            (
                (config.num_query_groups or config.num_attention_heads) != config.num_attention_heads,
                "grouped-query attention",
            ),
            (
                _kv_channels(config) * config.num_attention_heads != config.hidden_size,
                "kv_channels * heads != hidden_size",
            ),
            (bool(config.mtp_num_layers), "multi-token prediction layers"),
        ],
    )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": record.vocab_size,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size,
        "n_positions": record.max_sequence_length,
        "layer_norm_epsilon": config.layernorm_epsilon,
        "activation_function": activation,
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": record.share_embeddings_and_output_weights,
    }


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


def gpt2_state_dict_from_hf(hf_state_dict: dict, config: TransformerConfig, tied: bool = True) -> Mapping:
    """Our full state dict (made key by key on access) from a GPT2LMHeadModel state dict (Conv1D weights transposed)."""
    return _apply_from_hf(_gpt2_rules(config), _fill_tied_lm_head(hf_state_dict, "transformer.wte.weight", tied))


def gpt2_state_dict_to_hf(state_dict: dict, config: TransformerConfig, vocab_size: int) -> dict:
    """A GPT2LMHeadModel state dict from our full state dict."""
    return _apply_to_hf(_gpt2_rules(config), state_dict, vocab_size)


# ---------------------------------------------------------------- DeepSeek-V3 (DeepseekV3ForCausalLM)


def deepseek_v3_config_from_hf(hf_config, **overrides) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and GPTModel keyword arguments equivalent to a DeepseekV3Config:
    multi-latent attention (direct or low-rank queries; RoPE on ``qk_rope_head_dim`` channels,
    interleaved or not, default or YaRN), dense SwiGLU MLPs in the first ``first_k_dense_replace``
    layers, then MoE layers of SwiGLU experts routed DeepSeek's way (see :func:`_deepseek_routing`)
    beside ``n_shared_experts`` shared experts."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    _refuse(
        "DeepSeek-V3 settings not supported",
        [
            (hf_config.hidden_act != "silu", f"hidden_act {hf_config.hidden_act!r} (only 'silu': SwiGLU)"),
            (bool(hf_config.attention_bias), "attention biases (attention_bias must be False)"),
            (
                hf_config.num_key_value_heads != hf_config.num_attention_heads,
                f"num_key_value_heads {hf_config.num_key_value_heads} other than num_attention_heads "
                f"{hf_config.num_attention_heads} (multi-latent attention has no key/value groups)",
            ),
            (
                params.get("rope_type", "default") not in ("default", "yarn"),
                f"rope_type {params.get('rope_type')!r} (supported: 'default', 'yarn')",
            ),
        ],
    )
    rope, rope_fields = _hf_rope(hf_config, mla=True)
    layers = hf_config.num_hidden_layers
    dense = min(hf_config.first_k_dense_replace or 0, layers)
    moe = {}
    if dense < layers:
        shared = hf_config.n_shared_experts * hf_config.moe_intermediate_size
        moe = {
            **_deepseek_routing(hf_config, "DeepSeek-V3", shared or None, []),
            "moe_layer_freq": [0] * dense + [1] * (layers - dense) if dense else 1,
        }
    config = TransformerConfig(
        **{
            "num_layers": layers,
            "hidden_size": hf_config.hidden_size,
            "num_attention_heads": hf_config.num_attention_heads,
            "ffn_hidden_size": hf_config.intermediate_size,
            "normalization": "RMSNorm",
            "layernorm_epsilon": hf_config.rms_norm_eps,
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "add_bias_linear": False,
            "attention_dropout": float(hf_config.attention_dropout),
            "init_method_std": hf_config.initializer_range,
            "multi_latent_attention": True,
            "q_lora_rank": hf_config.q_lora_rank,
            "kv_lora_rank": hf_config.kv_lora_rank,
            "qk_head_dim": hf_config.qk_nope_head_dim,
            "qk_pos_emb_head_dim": hf_config.qk_rope_head_dim,
            "v_head_dim": hf_config.v_head_dim,
            "rotary_interleaved": bool(hf_config.rope_interleave),
            **rope_fields,
            **moe,
            **overrides,
        }
    )
    kwargs = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        **rope,
        "share_embeddings_and_output_weights": bool(hf_config.tie_word_embeddings),
    }
    return config, kwargs


def _leading_dense_layers(config: TransformerConfig) -> int | None:
    """How many dense layers come before the MoE ones (all of them without MoE); None when dense
    and MoE layers alternate otherwise (which DeepSeek-V3's ``first_k_dense_replace`` cannot say)."""
    if not config.num_moe_experts:
        return config.num_layers
    kinds = [config.is_moe_layer(number) for number in range(1, config.num_layers + 1)]
    dense = kinds.index(True)
    return dense if all(kinds[dense:]) else None


def deepseek_v3_config_to_hf(record) -> dict:
    """DeepseekV3Config keyword arguments for a GPT ``record`` with multi-latent attention,
    RMSNorm and SwiGLU, and (if any) MoE layers after its dense ones, routed DeepSeek's way
    with an expert bias and shared experts a whole number of experts wide."""
    config = record.config
    dense = _leading_dense_layers(config)
    moe = bool(config.num_moe_experts)
    shared = config.moe_shared_expert_intermediate_size or 0
    width = config.moe_ffn_hidden_size or config.ffn_hidden_size
    _require_exportable(
        "DeepseekV3ForCausalLM",
        [
            (not config.multi_latent_attention, "no multi-latent attention (needs --multi-latent-attention)"),
            (config.normalization != "RMSNorm", f"normalization {config.normalization!r} (DeepSeek-V3 uses RMSNorm)"),
            (
                not config.gated_linear_unit or config.activation_func is not F.silu,
                "an MLP other than SwiGLU (needs --swiglu)",
            ),
            (config.add_bias_linear or config.add_qkv_bias, "linear biases"),
            (
                record.position_embedding_type not in ("rope", "yarn"),
                f"position embeddings {record.position_embedding_type!r}",
            ),
            (record.rope_scaling, "Llama-3 RoPE scaling"),
            (bool(config.mtp_num_layers), "multi-token prediction layers"),
            (
                moe and config.moe_router_score_function != "sigmoid",
                f"{config.moe_router_score_function} router scores (DeepSeek-V3 routes by sigmoid scores)",
            ),
            (
                moe and not config.moe_router_enable_expert_bias,
                "no expert bias (needs --moe-router-enable-expert-bias)",
            ),
            (moe and config.moe_router_load_balancing_type == "sinkhorn", "Sinkhorn routing"),
            (moe and config.moe_expert_capacity_factor is not None, "token dropping (capacity factor)"),
            (
                moe and (shared == 0 or shared % width),
                f"shared experts {shared} wide (DeepSeek-V3 needs a whole number >= 1 of experts of {width})",
            ),
            (dense is None, f"MoE layers not all after the dense ones (moe_layer_freq {config.moe_layer_freq})"),
        ],
    )
    rope = {"rope_type": "default", "rope_theta": float(record.rotary_base)}
    if record.position_embedding_type == "yarn":
        rope = {**rope, **_yarn_rope_parameters(config)}
        rope |= {"mscale": config.yarn_mscale, "mscale_all_dim": config.yarn_mscale_all_dim}
        if not (config.yarn_mscale and config.yarn_mscale_all_dim):  # HF infers another factor then
            rope["attention_factor"] = yarn_concentration(config)
    groups = config.moe_router_num_groups or 1
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": record.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_head_dim,
        "qk_rope_head_dim": config.qk_pos_emb_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rotary_interleaved,
        "rope_parameters": rope,
        "first_k_dense_replace": dense,
        "n_routed_experts": config.num_moe_experts or 1,
        "num_experts_per_tok": config.moe_router_topk if moe else 1,
        "moe_intermediate_size": width,
        "n_shared_experts": shared // width if moe else 1,
        "n_group": groups,
        "topk_group": config.moe_router_group_topk or groups,
        "routed_scaling_factor": config.moe_router_topk_scaling_factor or 1.0,
        "norm_topk_prob": moe and config.moe_router_topk > 1,
        "num_mtp_layers": 0,
        "max_position_embeddings": record.max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": record.share_embeddings_and_output_weights,
    }


def _deepseek_v3_rules(config: TransformerConfig) -> list[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab=True)]
    attention = {"linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm"}
    attention |= {"linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
    if config.q_lora_rank is None:
        attention["linear_q_proj"] = "q_proj"
    else:
        attention |= {"linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj"}
    for i in range(config.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules.append(Rule(ours + "input_layernorm.weight", (hf + "input_layernorm.weight",)))
        rules.append(Rule(ours + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)))
        rules += [
            Rule(ours + f"self_attention.{name}.weight", (hf + f"self_attn.{hf_name}.weight",))
            for name, hf_name in attention.items()
        ]
        if not config.is_moe_layer(i + 1):
            rules += _swiglu_rules(ours + "mlp.", hf + "mlp.", config.ffn_hidden_size)
            continue
        rules += [
            Rule(ours + "mlp.router.weight", (hf + "mlp.gate.weight",)),
            Rule(ours + "mlp.router.expert_bias", (hf + "mlp.gate.e_score_correction_bias",)),
            Rule(ours + "mlp.experts.weight1", (hf + "mlp.experts.gate_up_proj",), transpose=True),
            Rule(ours + "mlp.experts.weight2", (hf + "mlp.experts.down_proj",), transpose=True),
            *_swiglu_rules(
                ours + "mlp.shared_experts.", hf + "mlp.shared_experts.", config.moe_shared_expert_intermediate_size
            ),
        ]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


def deepseek_v3_state_dict_from_hf(hf_state_dict: dict, config: TransformerConfig, tied: bool = False) -> Mapping:
    """Our full state dict (made key by key on access) from a DeepseekV3ForCausalLM state dict:
    transformers' stacked expert tensors, or the per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
    of a checkpoint on disk."""
    return _moe_state_dict_from_hf(hf_state_dict, config, tied, "mlp", HF_EXPERT_NAMES, _deepseek_v3_rules(config))


def deepseek_v3_state_dict_to_hf(state_dict: dict, config: TransformerConfig, vocab_size: int) -> dict:
    """A DeepseekV3ForCausalLM state dict from our full state dict."""
    return _apply_to_hf(_deepseek_v3_rules(config), state_dict, vocab_size)


# ---------------------------------------------------------------- NemotronH (NemotronHForCausalLM), hybrid


NEMOTRON_H_DISK_PREFIXES = {"backbone.": "model."}  # transformers saves the module's model.* as backbone.*
NEMOTRON_H_ACTIVATIONS = {"relu2": squared_relu, "silu": F.silu, "gelu": F.gelu}


def nemotron_h_config_from_hf(hf_config, **overrides) -> tuple[TransformerConfig, dict]:
    """TransformerConfig and HybridModel keyword arguments (``hybrid_layer_pattern`` included)
    equivalent to a NemotronHConfig; its M/*/- layer types become our pattern.

    HF's mixer clamps the Mamba step ``dt`` from below at ``time_step_min``; ours (like
    Megatron's) does not, so the two agree whenever ``softplus(dt + dt_bias) >= time_step_min``.
    """
    from megatron.core.models.hybrid.hybrid_layer_pattern import parse_hybrid_pattern

    unsupported = [
        (
            hf_config.attention_bias or hf_config.mlp_bias or hf_config.use_bias,
            "biases in linear layers (attention_bias, mlp_bias and use_bias must be False)",
        ),
        (not hf_config.use_conv_bias, "a Mamba conv without bias (use_conv_bias must be True)"),
        (hf_config.mamba_hidden_act != "silu", f"mamba_hidden_act {hf_config.mamba_hidden_act!r} (only 'silu')"),
        (
            hf_config.mlp_hidden_act not in NEMOTRON_H_ACTIVATIONS,
            f"mlp_hidden_act {hf_config.mlp_hidden_act!r} (supported: {sorted(NEMOTRON_H_ACTIVATIONS)})",
        ),
        (hf_config.num_nextn_predict_layers, "multi-token prediction layers (num_nextn_predict_layers must be 0)"),
    ]
    _refuse("NemotronH settings not supported", unsupported)
    pattern = hf_config.hybrid_override_pattern
    parse_hybrid_pattern(pattern)  # points at a character we do not know
    config = TransformerConfig(
        **{
            "num_layers": len(pattern),
            "hidden_size": hf_config.hidden_size,
            "num_attention_heads": hf_config.num_attention_heads,
            "num_query_groups": hf_config.num_key_value_heads,
            "kv_channels": hf_config.head_dim,
            "ffn_hidden_size": hf_config.intermediate_size,
            "normalization": "RMSNorm",
            "layernorm_epsilon": hf_config.layer_norm_epsilon,
            "activation_func": NEMOTRON_H_ACTIVATIONS[hf_config.mlp_hidden_act],
            "gated_linear_unit": False,
            "add_bias_linear": False,
            "hidden_dropout": float(hf_config.hidden_dropout),
            "attention_dropout": float(hf_config.attention_dropout),
            "init_method_std": hf_config.initializer_range,
            "mamba_state_dim": hf_config.ssm_state_size,
            "mamba_head_dim": hf_config.mamba_head_dim,
            "mamba_num_groups": hf_config.n_groups,
            "mamba_num_heads": hf_config.mamba_num_heads,
            "mamba_d_conv": hf_config.conv_kernel,
            "mamba_chunk_size": hf_config.chunk_size,
            **(_nemotron_h_moe_config(hf_config) if "E" in pattern else {}),
            **overrides,
        }
    )
    kwargs = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "hybrid_layer_pattern": pattern,
        "position_embedding_type": "none",
        "share_embeddings_and_output_weights": bool(hf_config.tie_word_embeddings),
    }
    return config, kwargs


def _nemotron_h_moe_config(hf_config) -> dict:
    """Our MoE fields for NemotronH's ``moe`` layers: DeepSeek's routing, relu2 experts plus one
    shared relu2 MLP."""
    unsupported = [
        (hf_config.moe_latent_size is not None, "a latent MoE projection (moe_latent_size must be None)"),
        (getattr(hf_config, "n_shared_experts", 1) != 1, "n_shared_experts other than 1"),
    ]
    return _deepseek_routing(hf_config, "NemotronH", hf_config.moe_shared_expert_intermediate_size, unsupported)


def _deepseek_routing(hf_config, family: str, shared_size: int | None, unsupported: list) -> dict:
    """Our MoE fields for DeepSeek's routing (NemotronH's and DeepSeek-V3's): sigmoid scores with
    a correction bias that only steers the choice, group-limited top-k, the chosen weights
    renormalized and scaled; ``shared_size``: the shared experts' width. ``unsupported``: the
    family's own ``(bad, what)`` checks, refused with these."""
    topk = hf_config.num_experts_per_tok
    _refuse(
        f"{family} MoE settings not supported",
        [
            *unsupported,
            (
                bool(hf_config.norm_topk_prob) != (topk > 1),
                f"norm_topk_prob={hf_config.norm_topk_prob} with num_experts_per_tok={topk} (weights are "
                "renormalized exactly when more than one expert is chosen)",
            ),
        ],
    )
    grouped = (hf_config.n_group or 1) > 1
    return {
        "num_moe_experts": hf_config.n_routed_experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": shared_size,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": hf_config.n_group if grouped else None,
        "moe_router_group_topk": hf_config.topk_group if grouped else None,
        "moe_router_topk_scaling_factor": float(hf_config.routed_scaling_factor),
        "moe_router_load_balancing_type": "none",
    }


def nemotron_h_config_to_hf(record) -> dict:
    """NemotronHConfig keyword arguments for a hybrid ``record`` (its pattern without ``|``).

    ``time_step_min`` is set tiny so HF's lower clamp of the Mamba ``dt`` (which ours does not
    have) changes nothing."""
    from megatron.core.models.hybrid.hybrid_layer_pattern import parse_hybrid_pattern

    config = record.config
    activation = {fn: name for name, fn in NEMOTRON_H_ACTIVATIONS.items()}.get(config.activation_func)
    _require_exportable(
        "NemotronHForCausalLM",
        [
            (config.normalization != "RMSNorm", f"normalization {config.normalization!r} (NemotronH uses RMSNorm)"),
            (config.gated_linear_unit, "a gated MLP"),
            (activation is None, f"MLP activation {getattr(config.activation_func, '__name__', '?')!r}"),
            (config.add_bias_linear or config.add_qkv_bias, "linear biases"),
            (record.position_embedding_type != "none", f"position embeddings {record.position_embedding_type!r}"),
            (bool(config.mtp_num_layers), "multi-token prediction layers"),
        ],
    )
    mamba_heads = config.mamba_num_heads or config.mamba_expand * config.hidden_size // config.mamba_head_dim
    return {
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": record.vocab_size,
        "hidden_size": config.hidden_size,
        "layers_block_type": None,
        "hybrid_override_pattern": parse_hybrid_pattern(record.layer_pattern).layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups or config.num_attention_heads,
        "head_dim": _kv_channels(config),
        "intermediate_size": config.ffn_hidden_size,
        "mlp_hidden_act": activation,
        "mamba_num_heads": mamba_heads,
        "mamba_head_dim": config.mamba_head_dim,
        "n_groups": config.mamba_num_groups,
        "ssm_state_size": config.mamba_state_dim,
        "conv_kernel": config.mamba_d_conv,
        "chunk_size": config.mamba_chunk_size,
        "max_position_embeddings": record.max_sequence_length,
        "layer_norm_epsilon": config.layernorm_epsilon,
        "hidden_dropout": config.hidden_dropout,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": record.share_embeddings_and_output_weights,
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "num_nextn_predict_layers": 0,
        "time_step_min": 1e-9,
    }


def _nemotron_h_rules(config: TransformerConfig, hybrid_layer_pattern: str) -> list[Rule]:
    from megatron.core.models.hybrid.hybrid_layer_pattern import ATTENTION, MAMBA, MOE, parse_hybrid_pattern

    q, kv = config.num_attention_heads * config.kv_channels, config.num_query_groups * config.kv_channels
    rules = [Rule("embedding.word_embeddings.weight", ("model.embeddings.weight",), vocab=True)]
    for i, symbol in enumerate(parse_hybrid_pattern(hybrid_layer_pattern).layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules.append(Rule(ours + "norm.weight", (hf + "norm.weight",)))
        if symbol == MAMBA:
            rules += [
                Rule(ours + f"mixer.{name}", (hf + f"mixer.{name}",))
                for name in ("in_proj.weight", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")
            ]
            rules += [
                Rule(ours + "mixer.conv1d_weight", (hf + "mixer.conv1d.weight",)),
                Rule(ours + "mixer.conv1d_bias", (hf + "mixer.conv1d.bias",)),
            ]
        elif symbol == ATTENTION:
            rules += [
                Rule(
                    ours + "self_attention.linear_qkv.weight",
                    tuple(hf + f"mixer.{p}_proj.weight" for p in "qkv"),
                    sizes=(q, kv, kv),
                ),
                Rule(ours + "self_attention.linear_proj.weight", (hf + "mixer.o_proj.weight",)),
            ]
        elif symbol == MOE:
            rules += [
                Rule(ours + "mlp.router.weight", (hf + "mixer.gate.weight",)),
                Rule(ours + "mlp.router.expert_bias", (hf + "mixer.gate.e_score_correction_bias",)),
                Rule(ours + "mlp.experts.weight1", (hf + "mixer.experts.up_proj",), transpose=True),
                Rule(ours + "mlp.experts.weight2", (hf + "mixer.experts.down_proj",), transpose=True),
                Rule(ours + "mlp.shared_experts.linear_fc1.weight", (hf + "mixer.shared_experts.up_proj.weight",)),
                Rule(ours + "mlp.shared_experts.linear_fc2.weight", (hf + "mixer.shared_experts.down_proj.weight",)),
            ]
        else:
            rules += [
                Rule(ours + "mlp.linear_fc1.weight", (hf + "mixer.up_proj.weight",)),
                Rule(ours + "mlp.linear_fc2.weight", (hf + "mixer.down_proj.weight",)),
            ]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm_f.weight",)))
    rules.append(Rule("output_layer.weight", ("lm_head.weight",), vocab=True))
    return rules


def nemotron_h_state_dict_from_hf(
    hf_state_dict: dict, config: TransformerConfig, hybrid_layer_pattern: str, tied: bool = False
) -> Mapping:
    """Our full HybridModel state dict (made key by key on access) from a NemotronHForCausalLM state dict."""
    return _apply_from_hf(
        _nemotron_h_rules(config, hybrid_layer_pattern),
        _fill_tied_lm_head(hf_state_dict, "model.embeddings.weight", tied),
    )


def nemotron_h_state_dict_to_hf(
    state_dict: dict, config: TransformerConfig, vocab_size: int, hybrid_layer_pattern: str
) -> dict:
    """A NemotronHForCausalLM state dict from our full HybridModel state dict."""
    return _apply_to_hf(_nemotron_h_rules(config, hybrid_layer_pattern), state_dict, vocab_size)
