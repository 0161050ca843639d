"""Shared pieces of decoder-only language models (GPT, hybrid): vocabulary padding, the input
embedding, RoPE, the output layer (tied or not, across pipeline stages), multi-token
prediction and the logits/loss post-processing of the last stage.

Tied weights across pipeline stages: the last stage builds its own copy of the word
embedding with the same ``init_rng_scope`` key, so both copies start identical; they carry
``shared_embedding = True`` and finalize_model_grads all-reduces their gradients over the
``embd`` group. Multi-token prediction on the last stage needs the input embedding there too,
so it is copied (and marked) the same way, position table included.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict, vocab_rows
from megatron.core.fusions.backend import fused_backend, needs_autograd
from megatron.core.fusions.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.fusions.linear_cross_entropy import linear_cross_entropy
from megatron.core.models.common.language_model_embedding import (
    LanguageModelEmbedding,
    check_position_embedding_type,
)
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    init_rng_scope,
    pad_vocab_size,
)
from megatron.core.transformer.context_parallel.sharding import cp_size_of, local_position_ids
from megatron.core.transformer.init_methods import init_method
from megatron.core.transformer.multi_token_prediction import (
    combine_mtp_losses,
    roll_left,
    shifted_target_mask,
)
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.spec import build_module


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Push the logits of padded vocabulary entries (ids >= ``vocab_size``) of this rank's
    slice to the dtype's minimum, so softmax and loss never see them (the padding depends on
    TP, so leaving it in would make the loss layout-dependent)."""
    local = logits.shape[-1]
    first_padded = vocab_size - tp_rank * local
    if first_padded >= local:
        return logits
    ids = torch.arange(local, device=logits.device)
    return logits.masked_fill(ids >= max(first_padded, 0), torch.finfo(logits.dtype).min)


class LanguageModule(nn.Module):
    """Base of GPTModel and HybridModel: builds everything but the decoder.

    Subclasses build ``self.decoder`` (a stage's layer stack); :meth:`forward` composes
    :meth:`embed`, :meth:`rotary`, the decoder and :meth:`postprocess`.

    ``linear_cross_entropy`` (True by default; ``--cross-entropy-fusion-impl native`` clears it):
    a training forward given ``labels`` and ``loss_mask`` computes the loss with the fused
    output-layer + cross-entropy op (:mod:`megatron.core.fusions.linear_cross_entropy`, the
    logits never materialized) where the backend switch runs ``linear_cross_entropy`` in Triton.

    The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by`` x TP (Megatron's
    rule); padded entries never win a softmax (their logits are masked) and checkpoints hold the
    true rows only, so the padding is a run's choice, not part of the model.
    """

    linear_cross_entropy = True

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        *,
        pre_process: bool,
        post_process: bool,
        fp16_lm_cross_entropy: bool,
        parallel_output: bool,
        share_embeddings_and_output_weights: bool,
        position_embedding_type: str,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        mtp_block_spec=None,
        pg_collection: ProcessGroupCollection | None = None,
        logit_dtype: torch.dtype | None = None,
        make_vocab_size_divisible_by: int = 128,
    ):
        super().__init__()
        check_position_embedding_type(position_embedding_type)
        self.config = config
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, self.pg_collection.size("tp"), make_vocab_size_divisible_by)
        self.max_sequence_length = max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.logit_dtype = logit_dtype
        self.mtp_enabled = self._check_mtp(config, mtp_block_spec)
        pp_size = self.pg_collection.size("pp")
        # Parameters that also live on the other end of the pipeline (grads summed over embd).
        copied_across_stages = pp_size > 1 and (share_embeddings_and_output_weights or self.mtp_enabled)
        if copied_across_stages and not config.layout_invariant_init:
            raise ConfigError(
                "tied embeddings or multi-token prediction with pipeline_model_parallel_size > 1 copy the "
                "embedding onto the last stage and need layout_invariant_init=True so both copies start equal"
            )

        self.embedding = None
        if pre_process or (post_process and (share_embeddings_and_output_weights or self.mtp_enabled)):
            needs_positions = pre_process or self.mtp_enabled
            self.embedding = LanguageModelEmbedding(
                config,
                self.padded_vocab_size,
                max_sequence_length,
                position_embedding_type if needs_positions else "none",
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
                pg_collection=self.pg_collection,
            )
            if copied_across_stages:
                self.embedding.word_embeddings.weight.shared_embedding = True
                if self.mtp_enabled and self.embedding.position_embeddings is not None:
                    self.embedding.position_embeddings.weight.shared_embedding = True

        self.rotary_pos_emb = None
        yarn, yarn_factor = position_embedding_type == "yarn", config.yarn_rotary_scaling_factor
        if yarn != (yarn_factor is not None) or (yarn and (rotary_percent != 1.0 or rope_scaling)):
            raise ConfigError(
                "position_embedding_type 'yarn' goes with config.yarn_rotary_scaling_factor set (and only with it), "
                f"rotary_percent 1.0 and no Llama-3 rope_scaling; got {position_embedding_type!r}, "
                f"{yarn_factor}, {rotary_percent}, {rope_scaling}"
            )
        if position_embedding_type in ("rope", "yarn"):
            rotary_channels = config.qk_pos_emb_head_dim if config.multi_latent_attention else config.kv_channels
            self.rotary_pos_emb = RotaryEmbedding(
                rotary_channels,
                rotary_percent,
                rotary_base,
                seq_len_interpolation_factor,
                rope_scaling,
                rope_scaling_factor,
                yarn_config=config if yarn else None,
            )

        self.output_layer = None
        self.mtp = None
        if post_process:
            self.output_layer = self._build_output_layer(config)
            if self.mtp_enabled:
                self.mtp = build_module(mtp_block_spec, config=config, pg_collection=self.pg_collection)

    @staticmethod
    def _check_mtp(config: TransformerConfig, mtp_block_spec) -> bool:
        enabled = bool(config.mtp_num_layers)
        if enabled != (mtp_block_spec is not None):
            raise ConfigError(
                f"multi-token prediction needs both config.mtp_num_layers >= 1 and an mtp_block_spec; got "
                f"mtp_num_layers={config.mtp_num_layers!r} and mtp_block_spec={'set' if mtp_block_spec else None}"
            )
        return enabled

    def _build_output_layer(self, config: TransformerConfig) -> ColumnParallelLinear:
        tied = self.share_embeddings_and_output_weights
        # A tied output layer's own weight is replaced at once: skip initializing it.
        layer_config = dataclasses.replace(config, perform_initialization=False) if tied else config
        with init_rng_scope(config, "output_layer"):
            output_layer = ColumnParallelLinear(
                config.hidden_size,
                self.padded_vocab_size,
                config=layer_config,
                init_method=init_method(config),
                bias=False,
                gather_output=False,
                pg_collection=self.pg_collection,
                output_dtype=self.logit_dtype,
            )
        if tied:
            output_layer.weight = self.embedding.word_embeddings.weight
        return output_layer

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        decoder_input: torch.Tensor | None = None,
        inference_context=None,
        *,
        return_decoder_output: bool = False,
        loss_mask: torch.Tensor | None = None,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Last stage: loss [b, s] with ``labels``, else logits [b, s, V]. Other stages: the
        hidden states [s, b, h] for the next stage. ``decoder_input`` [s, b, h] replaces the
        embedding on the first stage; ``inference_context`` reaches every attention and Mamba
        layer of ``self.decoder`` (it must serve both protocols when a model mixes them).
        ``return_decoder_output``: the last stage returns ``(loss or logits, decoder output
        [s, b, h])``, the decoder output being what multi-token prediction starts from.
        ``loss_mask`` [b, s] (Megatron's keyword): the weights the caller sums the per-token loss
        with, up to one scalar factor (its gradient must be proportional to them); it lets the
        loss take the fused linear cross-entropy (see the class). ``logit_rows`` [n] (inference,
        batch 1, no ``labels``): the logits of those sequence positions only, ``[1, n, V]``."""
        if logit_rows is not None and (labels is not None or (input_ids is not None and input_ids.shape[0] != 1)):
            raise ValueError("logit_rows selects sequence positions of one sequence's logits (batch 1, no labels)")
        position_ids = self._default_position_ids(input_ids, position_ids, labels)
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, position_ids)
        rotary_pos_emb = self.rotary(position_ids)
        hidden_states = self.decoder(
            decoder_input,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            inference_context=inference_context,
        )
        if not self.post_process:
            return hidden_states
        output = self.postprocess(
            hidden_states if logit_rows is None else hidden_states.index_select(0, logit_rows),
            input_ids,
            position_ids,
            labels,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            loss_mask=loss_mask,
        )
        return (output, hidden_states) if return_decoder_output else output

    def _default_position_ids(self, input_ids, position_ids, labels):
        """``position_ids``, or the positions of the given tokens: ``0..s-1``, or under context
        parallelism the global positions of this rank's chunks."""
        tokens = input_ids if input_ids is not None else labels
        if position_ids is None and tokens is not None and cp_size_of(self.pg_collection) > 1:
            return local_position_ids(tokens, self.pg_collection.cp)
        return self.position_ids_for(input_ids, position_ids, labels)

    def set_input_tensor(self, input_tensor) -> None:
        """Feed a non-first pipeline stage with the previous stage's hidden states [s, b, h]."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"set_input_tensor takes one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    @staticmethod
    def position_ids_for(
        input_ids: torch.Tensor | None, position_ids: torch.Tensor | None, labels: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``position_ids`` when given, else ``0..s-1`` for every sequence of the batch."""
        if position_ids is not None:
            return position_ids
        tokens = input_ids if input_ids is not None else labels
        if tokens is None:
            return None
        b, s = tokens.shape
        return torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Input embedding [s, b, h] (first stage)."""
        return self.embedding(input_ids, position_ids)

    def rotary(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """RoPE angles [s, b, 1, d] for ``position_ids``, or None without RoPE."""
        if self.rotary_pos_emb is None:
            return None
        if position_ids is None:
            raise ValueError("RoPE needs position_ids (or input_ids or labels to derive them) on every stage")
        return self.rotary_pos_emb(position_ids)

    def vocab_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This TP rank's logits [s, b, V_padded/tp] with the vocabulary padding masked."""
        logits, _ = self.output_layer(hidden_states)
        return mask_vocab_padding(logits, self.vocab_size, self.pg_collection.rank("tp"))

    def per_token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel cross-entropy of ``logits`` [s, b, V/tp] against ``labels`` [b, s]: [b, s]
        (fp32 math unless ``fp16_lm_cross_entropy``; the fused path never copies the logits to
        fp32 and reuses their storage for their gradient)."""
        loss = vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp, upcast=not self.fp16_lm_cross_entropy
        )
        return loss.transpose(0, 1).contiguous()

    def fuses_loss(self, hidden_states: torch.Tensor, loss_mask: torch.Tensor | None) -> bool:
        """Whether the loss of ``hidden_states`` takes the fused linear cross-entropy: a training
        forward with a loss mask, the op on Triton, a plain TP output weight (not GTP-sharded)."""
        weight = self.output_layer.weight
        return (
            self.linear_cross_entropy
            and loss_mask is not None
            and not weight.gtp_sharded
            and needs_autograd(hidden_states, weight)
            and fused_backend("linear_cross_entropy", hidden_states.device) == "triton"
        )

    def fused_per_token_loss(
        self, hidden_states: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`per_token_loss` of the output layer's logits of ``hidden_states`` [s, b, h]
        without materializing them: [b, s]."""
        loss = linear_cross_entropy(
            self.output_layer.input_in_tp_region(hidden_states),
            self.output_layer.weight,
            labels.transpose(0, 1),
            self.pg_collection.tp,
            vocab_size=self.vocab_size,
            token_weight=loss_mask.transpose(0, 1),
            logit_dtype=self.logit_dtype,
            upcast=not self.fp16_lm_cross_entropy,
        )
        return loss.transpose(0, 1).contiguous()

    def postprocess(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last stage: per-token loss [b, s] (with the MTP terms) when ``labels`` are given,
        else logits [b, s, V] (or [b, s, V_padded/tp] with ``parallel_output``)."""
        if labels is not None and self.fuses_loss(hidden_states, loss_mask):
            loss = self.fused_per_token_loss(hidden_states, labels, loss_mask)
        else:
            logits = self.vocab_logits(hidden_states)
            if labels is None:
                if not self.parallel_output:
                    logits = gather_from_tensor_model_parallel_region(logits, self.pg_collection.tp)
                    logits = logits[..., : self.vocab_size]
                return logits.transpose(0, 1).contiguous()
            loss = self.per_token_loss(logits, labels)
        if self.mtp is None:
            return loss
        if input_ids is None:
            raise ValueError("multi-token prediction needs input_ids on the last pipeline stage")
        depth_hidden = self.mtp(
            input_ids,
            position_ids,
            hidden_states,
            self.embed,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
        )
        cp_group = self.mtp.cp_group
        depth_losses = [
            self.per_token_loss(self.vocab_logits(hidden), roll_left(labels, depth, cp_group=cp_group))
            * shifted_target_mask(labels, depth, cp_group=cp_group)
            for depth, hidden in enumerate(depth_hidden, start=1)
        ]
        return combine_mtp_losses(loss, depth_losses, self.config.mtp_loss_scaling_factor)

    def sharded_state_dict(self, prefix: str = "", metadata: dict | None = None) -> dict:
        """This stage's parameters as checkpoint pieces (global layer numbers, true vocabulary
        rows; see :mod:`megatron.core.dist_checkpointing.model_state`), keyed by local name.
        ``metadata`` (Megatron's format options) must be empty: no options are defined."""
        if metadata:
            raise ValueError(f"sharded_state_dict takes no format options yet, got metadata={metadata!r}")
        return model_sharded_state_dict(self, self.pg_collection, prefix, vocab_rows(self))
