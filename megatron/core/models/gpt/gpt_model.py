"""GPT: embedding -> transformer decoder -> output layer, split over pipeline stages."""

from __future__ import annotations

import torch

from megatron.core.config import TransformerConfig
from megatron.core.models.common.language_module import LanguageModule
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.context_parallel import check_context_parallel_config
from megatron.core.transformer.spec import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock


class GPTModel(LanguageModule):
    """Decoder-only transformer language model.

    The signature is frozen (positional indexes are part of the API); new parameters go last.
    ``pre_process`` / ``post_process`` say whether this is the first / last pipeline stage.
    With ``config.virtual_pipeline_model_parallel_size`` V, ``vp_stage`` (0..V-1) picks the model
    chunk: chunk v of pipeline rank p holds the layers of virtual stage ``v * PP + p``
    (:func:`~megatron.core.transformer.transformer_block.virtual_stage_index`).
    The vocabulary is padded with ``pad_vocab_size``; padded entries never reach logits or loss.
    ``logit_dtype`` is the dtype the output layer's GEMM writes (e.g. fp32 logits of a bf16 model,
    accumulated in fp32 and never rounded to bf16); the returned logits and the loss use them.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec | list[ModuleSpec],
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        mtp_block_spec: ModuleSpec | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        logit_dtype: torch.dtype | None = None,
        make_vocab_size_divisible_by: int = 128,
    ):
        pg_collection = resolve_pg_collection(pg_collection)
        check_context_parallel_config(config, pg_collection)
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
            rope_scaling=rope_scaling,
            rope_scaling_factor=rope_scaling_factor,
            scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            mtp_block_spec=mtp_block_spec,
            pg_collection=pg_collection,
            logit_dtype=logit_dtype,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        )
        self.transformer_layer_spec = transformer_layer_spec
        self.vp_stage = vp_stage
        self.decoder = TransformerBlock(
            config, transformer_layer_spec, pre_process, post_process, pg_collection, vp_stage
        )
