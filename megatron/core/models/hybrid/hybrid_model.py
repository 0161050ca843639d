"""Hybrid Mamba/attention/MLP language model: embedding -> hybrid stack -> output layer."""

from __future__ import annotations

import torch

from megatron.core.config import TransformerConfig
from megatron.core.models.common.language_module import LanguageModule
from megatron.core.models.hybrid.hybrid_layer_pattern import resolve_hybrid_pattern
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_mtp_block_spec
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.context_parallel import check_context_parallel_config
from megatron.core.transformer.spec import ModuleSpec, build_module


class HybridModel(LanguageModule):
    """Decoder-only language model whose layers follow a hybrid pattern (see
    :mod:`hybrid_layer_pattern`): ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``|`` pipeline
    stage boundary, ``/`` multi-token-prediction depths.

    The signature is frozen (positional indexes are part of the API); new parameters go last.
    The pattern comes from ``hybrid_layer_pattern``, else the legacy
    ``hybrid_override_pattern``, else the ratios; its main part must have
    ``config.num_layers`` layers and its ``/`` parts must number ``config.mtp_num_layers``.
    Each pipeline stage builds only its ``|`` segments, with global layer numbers; with
    ``config.virtual_pipeline_model_parallel_size`` V, chunk ``vp_stage`` of rank p builds the
    segments of virtual stage ``vp_stage * PP + p`` (the pattern needs a multiple of PP x V).
    ``logit_dtype`` is the dtype the output layer's GEMM writes (e.g. fp32 logits of a bf16 model,
    accumulated in fp32 and never rounded to bf16); the returned logits and the loss use them.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hybrid_stack_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        hybrid_layer_pattern: str | None = None,
        hybrid_attention_ratio: float | None = None,
        hybrid_mlp_ratio: float | None = None,
        hybrid_override_pattern: str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        logit_dtype: torch.dtype | None = None,
        make_vocab_size_divisible_by: int = 128,
    ):
        pg_collection = resolve_pg_collection(pg_collection)
        layer_pattern = resolve_hybrid_pattern(
            config.num_layers,
            config.mtp_num_layers,
            hybrid_layer_pattern,
            hybrid_attention_ratio,
            hybrid_mlp_ratio,
            hybrid_override_pattern,
            config.num_moe_experts,
        )
        check_context_parallel_config(config, pg_collection)
        mtp_block_spec = (
            get_hybrid_mtp_block_spec(hybrid_stack_spec, layer_pattern.mtp_patterns)
            if layer_pattern.mtp_patterns
            else None
        )
        super().__init__(
            config,
            vocab_size,
            max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=fp16_lm_cross_entropy,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            mtp_block_spec=mtp_block_spec,
            pg_collection=pg_collection,
            logit_dtype=logit_dtype,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        )
        self.layer_pattern = layer_pattern
        self.hybrid_stack_spec = hybrid_stack_spec
        self.vp_stage = vp_stage
        self.decoder = build_module(
            hybrid_stack_spec,
            config=config,
            layer_pattern=layer_pattern,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
