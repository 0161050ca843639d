"""Runs one step of a (possibly tensor- and pipeline-parallel) model over the dynamic context.

Every rank of a model-parallel group runs the same engine on the same requests, so all ranks
build the same :class:`StepBatch` in the same order. Every stage runs the model's own forward,
``model(token_ids, positions, inference_context=context)``, over the packed step (the context's
hooks serve each attention and Mamba layer); hidden states ``[T, 1, h]`` go from stage to stage
through the pipeline's :class:`~megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator`
(``T``: the step's padded token count, known to both sides). The last stage turns its logits
into full-vocabulary fp32 logits (gathered over TP) and samples; its per-step decisions reach the
other stages as one tensor through :meth:`ModelRunner.share_from_last_stage`.

:func:`stage_cache_spec` reads which attention and Mamba layers this stage holds (the
multi-token-prediction layers keep no cache: see :mod:`engines.speculative`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.inference.contexts.capacity import StageCacheSpec
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext, StepBatch
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mla import MLASelfAttention


def model_is_hybrid(model: nn.Module) -> bool:
    """Whether the whole model (every stage, not just this one) has Mamba layers."""
    pattern = getattr(model, "layer_pattern", None)
    return pattern is not None and "M" in pattern.layers


def stage_cache_spec(model: nn.Module, block_size: int, tp_size: int) -> StageCacheSpec:
    """The attention and Mamba layers of this stage's decoder (global numbers) and their
    TP-local KV / state shapes."""
    attention, mamba = [], []
    for module in model.decoder.modules():
        if isinstance(module, (SelfAttention, MLASelfAttention)):
            attention.append(module.layer_number)
        elif isinstance(module, MambaMixer):
            mamba.append(module.layer_number)
    return StageCacheSpec.from_config(model.config, sorted(attention), sorted(mamba), block_size, tp_size)


class ModelRunner:
    """One pipeline stage's share of a forward step (see module doc).

    Args:
        model: this stage's GPTModel / HybridModel (``pre_process`` / ``post_process`` set).
        pg_collection: its groups (``tp`` and ``pp`` used).
    """

    def __init__(self, model: nn.Module, pg_collection: ProcessGroupCollection | None = None):
        self.model = model
        self.pg = resolve_pg_collection(pg_collection)
        self.config = model.config
        self.pp_size, self.pp_rank = self.pg.size("pp"), self.pg.rank("pp")
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        self.vocab_size = model.vocab_size
        self.device = next(model.parameters()).device

    def _stage_rank(self, stage: int) -> int:
        return dist.get_global_rank(self.pg.pp, stage)

    def _pipeline(self, num_tokens: int) -> P2PCommunicator:
        shape = (num_tokens, 1, self.config.hidden_size)
        return P2PCommunicator(self.pg.pp, shape, self.config.params_dtype, self.device)

    @torch.no_grad()
    def forward(
        self, context: DynamicInferenceContext, batch: StepBatch, logit_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run this stage on ``batch``; on the last stage return ``(logits [T, V] fp32,
        hidden [T, h])`` (hidden: the decoder output the MTP heads take), else None.
        ``logit_rows`` (the last stage's): the packed rows to project onto the vocabulary (the
        logits then hold those rows, in that order); None: every row."""
        pipeline = self._pipeline(batch.num_padded_tokens) if self.pp_size > 1 else None
        if not self.is_first_stage:
            self.model.set_input_tensor(pipeline.recv_forward())
        output = self.model(
            batch.token_ids[None],  # [b=1, T]
            batch.positions[None],
            inference_context=context,
            return_decoder_output=self.is_last_stage,
            logit_rows=logit_rows if self.is_last_stage else None,
        )
        if not self.is_last_stage:
            pipeline.send_forward(output)
            return None
        logits, hidden = output
        logits = self.full_vocabulary(logits) if self.model.parallel_output else logits.float()
        return logits[0], hidden[:, 0]

    def full_vocabulary(self, local_logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the true vocabulary from this TP rank's slice ``[..., V_padded / tp]``."""
        return gather_from_tensor_model_parallel_region(local_logits, self.pg.tp)[..., : self.vocab_size].float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits ``[s, b, V]`` of decoder outputs ``hidden [s, b, h]``."""
        return self.full_vocabulary(self.model.vocab_logits(hidden))

    def share_from_last_stage(self, packed: torch.Tensor) -> torch.Tensor:
        """The last stage's ``packed`` tensor on every stage (the others pass one of the same shape
        and dtype to receive into): one broadcast over the ``pp`` group, nothing pickled."""
        if self.pp_size == 1:
            return packed
        device = self.device if dist.get_backend(self.pg.pp) == "nccl" else torch.device("cpu")
        packed = packed.to(device)
        dist.broadcast(packed, src=self._stage_rank(self.pp_size - 1), group=self.pg.pp)
        return packed
