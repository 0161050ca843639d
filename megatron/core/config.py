"""Model-parallel and transformer configuration dataclasses, validated once in __post_init__.

Every error is a :class:`ConfigError` (a :class:`~megatron.core.errors.MegatronConfigError`,
so a ``ValueError``) naming the fields at fault and what would be accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron.core.activations import ACTIVATIONS
from megatron.core.errors import MegatronConfigError

# Megatron's --attention-backend values (what each selects: megatron.core.transformer.attention).
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
# What selective recompute can cover: the attention core; a dense MLP; an MoE layer; its shared
# experts; its experts' activation (recomputed with the second expert GEMM that reads it).
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "moe_act")
# The TransformerConfig fields that shape multi-latent attention (each also its flag's dest).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


class ConfigError(MegatronConfigError):
    """An invalid configuration; the message names the fields that disagree."""


def activation_name(func: Callable) -> str:
    """The registered name of an activation function (see ``megatron.core.activations``)."""
    for name, registered in ACTIVATIONS.items():
        if registered is func:
            return name
    raise ConfigError(
        f"activation_func {getattr(func, '__name__', func)!r} has no registered name, so a saved config could not "
        f"name it; use one of {sorted(ACTIVATIONS)} or add it to megatron.core.activations.ACTIVATIONS"
    )


def activation_from_name(name: str) -> Callable:
    """Inverse of :func:`activation_name`."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation_func {name!r} is unknown; known activations: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclass
class ModelParallelConfig:
    """Parallel sizes and numeric settings shared by every module."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    # How attention exchanges K/V under CP > 1: "p2p" (ring attention) or "all_gather".
    cp_comm_type: str = "p2p"
    generalized_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False
    # Mean-loss (False) or per-token-loss (True) gradient scaling of GTP reduce-scatter.
    calculate_per_token_loss: bool = False
    # Model chunks per pipeline rank for the interleaved schedule (None: one, not interleaved).
    virtual_pipeline_model_parallel_size: int | None = None
    # Linear layers' weight-gradient GEMMs accumulate into DDP's main_grad where one GEMM can (on
    # CUDA; see megatron.core.distributed.main_grad). Megatron's default; a run's choice.
    gradient_accumulation_fusion: bool = True

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "generalized_tensor_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.cp_comm_type not in ("p2p", "all_gather"):
            raise ConfigError(f"cp_comm_type must be 'p2p' or 'all_gather', got {self.cp_comm_type!r}")
        vp_size = self.virtual_pipeline_model_parallel_size
        if vp_size is not None and (not isinstance(vp_size, int) or vp_size < 1):
            raise ConfigError(f"virtual_pipeline_model_parallel_size must be None or an integer >= 1, got {vp_size!r}")
        if vp_size is not None and vp_size > 1 and self.pipeline_model_parallel_size == 1:
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size ({vp_size}) needs pipeline_model_parallel_size > 1; "
                "interleaving only splits pipeline stages"
            )
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both set; choose one")
        if self.bf16 and self.params_dtype == torch.float32:
            self.params_dtype = torch.bfloat16
        if self.fp16 and self.params_dtype == torch.float32:
            self.params_dtype = torch.float16


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Shape and behaviour of a GPT or hybrid Mamba/attention model."""

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # The SDPA kernels core attention may use (Megatron's --attention-backend): see
    # megatron.core.transformer.attention.sdpa_backends.
    attention_backend: str = "auto"
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    # Norms multiply by (1 + weight), weights initialized to 0 (Megatron's --apply-layernorm-1p).
    layernorm_zero_centered_gamma: bool = False
    gated_linear_unit: bool = False  # SwiGLU when activation_func is silu
    activation_func: Callable = F.gelu
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False  # per-head norm of queries and keys before RoPE (Megatron's --qk-layernorm)
    # RoPE turns channel pairs (2i, 2i + 1) (GPT-J's layout) instead of (i, i + d/2) (Llama's).
    rotary_interleaved: bool = False
    # Multi-latent attention (DeepSeek's MLA, Megatron's --multi-latent-attention): queries from a
    # low-rank projection when q_lora_rank is set, keys and values from a kv_lora_rank latent; each
    # head's query/key is qk_head_dim unrotated channels plus qk_pos_emb_head_dim rotated ones
    # (the rotated key is shared by all heads), its value v_head_dim channels.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # YaRN RoPE (the model's position_embedding_type "yarn"; Megatron's --rotary-scaling-factor,
    # --mscale, --mscale-all-dim and --yarn-*): frequencies blended between the scaled and the
    # original ones by rotation count, and attention logits scaled by the concentration factor
    # squared (see megatron.core.transformer.rope). None: no YaRN.
    yarn_rotary_scaling_factor: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    init_method_std: float = 0.02
    # Scale output-projection init by 1/sqrt(2 * num_layers) (GPT-2 style).
    apply_scaled_init_to_output_layers: bool = True
    attention_softmax_in_fp32: bool = True
    # Same seed -> same full weights under every TP/GTP/PP layout (each rank slices).
    layout_invariant_init: bool = True
    init_seed: int = 1234
    perform_initialization: bool = True
    # Mamba-2 (validated against TP by the Mamba mixer, which only hybrid models build)
    mamba_state_dim: int = 16
    mamba_head_dim: int = 16
    mamba_num_groups: int = 1
    mamba_num_heads: int | None = None
    mamba_expand: int = 2
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 16
    # Uneven pipeline stages (Megatron's names): layers of the first / last pipeline stage, the
    # others sharing the rest evenly (None: an even split); not with virtual stages.
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    # Multi-token prediction
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    # Activation recomputation: None, "full" or "selective". Full recompute (Megatron's
    # methods): "uniform" checkpoints each run of recompute_num_layers layers as one unit,
    # "block" checkpoints the first recompute_num_layers layers of a stage one by one and keeps
    # the others' activations; None is uniform over single layers.
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # Selective recompute's parts (Megatron's --recompute-modules, of RECOMPUTE_MODULES); None:
    # the attention core alone, Megatron's default.
    recompute_modules: list[str] | None = None
    # Mixture of experts (Megatron's names; num_moe_experts None: dense MLPs)
    num_moe_experts: int | None = None
    # Which layers are MoE (Megatron's --moe-layer-freq): every k-th from the first (an int), or
    # one 0/1 per layer (a list; e.g. DeepSeek's first dense layers). GPT models only.
    moe_layer_freq: int | list[int] = 1
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_load_balancing_type: str = "aux_loss"  # "aux_loss", "seq_aux_loss", "sinkhorn" or "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_score_function: str = "softmax"  # or "sigmoid"
    moe_router_pre_softmax: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Group-limited routing (DeepSeek-V3, NemotronH): experts in num_groups groups, top-k within
    # the group_topk groups of highest (top-2 summed) scores.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None  # routing weights scaled by it
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_dispatcher_type: str = "allgather"  # or "alltoall"
    moe_grouped_gemm: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        errors = []
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                errors.append(f"{name} must be a positive integer, got {value!r}")
        if errors:
            raise ConfigError("; ".join(errors))
        tp = self.tensor_model_parallel_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) when kv_channels is not set"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.mamba_num_heads is None:
            self.mamba_num_heads = self.mamba_expand * self.hidden_size // self.mamba_head_dim
        checks = [
            (
                not self.multi_latent_attention
                or (
                    self.num_query_groups == self.num_attention_heads
                    and not self.qk_layernorm
                    and min(self.kv_lora_rank, self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim) >= 1
                    and self.qk_pos_emb_head_dim % 2 == 0
                    and (self.q_lora_rank is None or self.q_lora_rank >= 1)
                ),
                "multi_latent_attention needs num_query_groups == num_attention_heads (no GQA), no qk_layernorm, "
                "positive kv_lora_rank / qk_head_dim / v_head_dim (and q_lora_rank when set) and an even "
                f"qk_pos_emb_head_dim; got {self.num_query_groups}/{self.num_attention_heads} groups, "
                f"qk_layernorm={self.qk_layernorm}, ranks {self.q_lora_rank}/{self.kv_lora_rank}, head dims "
                f"{self.qk_head_dim}/{self.qk_pos_emb_head_dim}/{self.v_head_dim}",
            ),
            (
                self.yarn_rotary_scaling_factor is None or self.yarn_rotary_scaling_factor > 0,
                f"yarn_rotary_scaling_factor must be > 0, got {self.yarn_rotary_scaling_factor!r}",
            ),
            (
                self.num_attention_heads % tp == 0,
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"tensor_model_parallel_size ({tp})",
            ),
            (
                self.num_query_groups % tp == 0,
                f"num_query_groups ({self.num_query_groups}) must be divisible by tensor_model_parallel_size ({tp})",
            ),
            (
                self.num_attention_heads % self.num_query_groups == 0,
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups "
                f"({self.num_query_groups})",
            ),
            (
                self.ffn_hidden_size % tp == 0,
                f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by tensor_model_parallel_size ({tp})",
            ),
            (
                self.attention_backend in ATTENTION_BACKENDS,
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
            ),
            (
                self.normalization in ("LayerNorm", "RMSNorm"),
                f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}",
            ),
            (
                self.recompute_granularity in (None, "full", "selective"),
                f"recompute_granularity must be None, 'full' or 'selective', got {self.recompute_granularity!r}",
            ),
            *(
                (
                    value is None or (isinstance(value, int) and value >= 0),
                    f"{name} must be None or an integer >= 0, got {value!r}",
                )
                for name, value in (
                    ("num_layers_in_first_pipeline_stage", self.num_layers_in_first_pipeline_stage),
                    ("num_layers_in_last_pipeline_stage", self.num_layers_in_last_pipeline_stage),
                )
            ),
            (
                self.recompute_method is None
                or (self.recompute_method in ("uniform", "block") and self.recompute_granularity == "full"),
                f"recompute_method must be None, or 'uniform' or 'block' with recompute_granularity 'full'; got "
                f"{self.recompute_method!r} with {self.recompute_granularity!r}",
            ),
            (
                self.recompute_modules is None
                or (
                    set(self.recompute_modules) <= set(RECOMPUTE_MODULES) and self.recompute_granularity == "selective"
                ),
                f"recompute_modules must be None, or some of {', '.join(RECOMPUTE_MODULES)} with recompute_granularity "
                f"'selective'; got {self.recompute_modules!r} with {self.recompute_granularity!r}",
            ),
            (
                self.recompute_num_layers is None
                or (self.recompute_num_layers >= 1 and self.recompute_granularity == "full"),
                f"recompute_num_layers must be None, or >= 1 with recompute_granularity 'full'; got "
                f"{self.recompute_num_layers!r} with {self.recompute_granularity!r}",
            ),
            (
                self.mtp_num_layers is None or self.mtp_num_layers >= 0,
                f"mtp_num_layers must be >= 0, got {self.mtp_num_layers!r}",
            ),
        ]
        errors = [message for ok, message in checks if not ok]
        if self.num_moe_experts is not None:
            errors += self._moe_errors()
        if errors:
            raise ConfigError("; ".join(errors))

    def _moe_errors(self) -> list[str]:
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        experts, topk = self.num_moe_experts, self.moe_router_topk
        checks = [
            (isinstance(experts, int) and experts >= 1, f"num_moe_experts must be an integer >= 1, got {experts!r}"),
            (
                isinstance(topk, int) and 1 <= topk <= (experts if isinstance(experts, int) else 0),
                f"moe_router_topk must be in [1, num_moe_experts ({experts})], got {topk!r}",
            ),
            (
                self.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
                "moe_router_load_balancing_type must be 'aux_loss', 'seq_aux_loss', 'sinkhorn' or 'none', "
                f"got {self.moe_router_load_balancing_type!r}",
            ),
            (
                self.moe_router_load_balancing_type != "sinkhorn" or not self.moe_aux_loss_coeff,
                "sinkhorn load balancing balances the expert choice itself: it takes no moe_aux_loss_coeff "
                f"(got {self.moe_aux_loss_coeff!r})",
            ),
            (
                self.moe_router_score_function in ("softmax", "sigmoid"),
                f"moe_router_score_function must be 'softmax' or 'sigmoid', got {self.moe_router_score_function!r}",
            ),
            (
                self.moe_token_dispatcher_type in ("allgather", "alltoall"),
                f"moe_token_dispatcher_type must be 'allgather' or 'alltoall', got {self.moe_token_dispatcher_type!r}",
            ),
            (
                self.moe_expert_capacity_factor is None or self.moe_expert_capacity_factor > 0,
                f"moe_expert_capacity_factor must be None (dropless) or > 0, got {self.moe_expert_capacity_factor!r}",
            ),
            (
                (self.moe_router_num_groups is None) == (self.moe_router_group_topk is None)
                and (
                    self.moe_router_num_groups is None
                    or (
                        experts % self.moe_router_num_groups == 0
                        and 1 <= self.moe_router_group_topk <= self.moe_router_num_groups
                    )
                ),
                "moe_router_num_groups and moe_router_group_topk go together: num_moe_experts "
                f"({experts}) divisible by moe_router_num_groups ({self.moe_router_num_groups}) and "
                f"1 <= moe_router_group_topk ({self.moe_router_group_topk}) <= moe_router_num_groups",
            ),
            (
                self.moe_aux_loss_coeff >= 0,
                f"moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff!r}",
            ),
            (
                (isinstance(self.moe_layer_freq, int) and self.moe_layer_freq >= 1)
                or (
                    isinstance(self.moe_layer_freq, list)
                    and len(self.moe_layer_freq) == self.num_layers
                    and set(self.moe_layer_freq) <= {0, 1}
                ),
                f"moe_layer_freq must be an integer >= 1 or a list of {self.num_layers} zeros and ones (one per "
                f"layer), got {self.moe_layer_freq!r}",
            ),
        ]
        return [message for ok, message in checks if not ok]

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` (one of :data:`RECOMPUTE_MODULES`) in training."""
        return self.recompute_granularity == "selective" and module in (self.recompute_modules or ["core_attn"])

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the MLP of (1-based, global) layer ``layer_number`` is an MoE layer."""
        if self.num_moe_experts is None:
            return False
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer_number - 1])
        return (layer_number - 1) % self.moe_layer_freq == 0

    def to_dict(self) -> dict:
        """JSON-safe description (dtype and activation by name) for checkpoints."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif f.name == "activation_func":
                value = activation_name(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        """Inverse of :meth:`to_dict`. Raises ConfigError naming every field this version does
        not know (a record from a newer version, or a typo: nothing is silently dropped) and for
        unknown activation names."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown {cls.__name__} field(s) {', '.join(map(repr, unknown))}; accepted fields: {', '.join(known)}"
            )
        data = dict(data)
        if isinstance(data.get("params_dtype"), str):
            data["params_dtype"] = getattr(torch, data["params_dtype"])
        if isinstance(data.get("activation_func"), str):
            data["activation_func"] = activation_from_name(data["activation_func"])
        return cls(**data)
