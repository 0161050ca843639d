"""Runs one step of a (possibly tensor- and pipeline-parallel) model over the dynamic context.

Every rank of a model-parallel group runs the same engine on the same requests, so all ranks
build the same :class:`StepBatch` in the same order. The first pipeline stage embeds the
packed tokens; each stage runs its layers through the context's hooks and sends its hidden
states ``[T, 1, h]`` to the next stage (``torch.distributed`` send/recv over the ``pp``
group; ``T`` is fixed by the step padding, so shapes are known to both sides). The last stage
computes the full-vocabulary logits (gathered over TP) and samples; its per-step results reach
the other stages through :meth:`ModelRunner.share_from_last_stage`.

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
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention


def model_is_hybrid(model: nn.Module) -> bool:
    """Whether the whole model (every stage, not just this one) has Mamba layers."""
    pattern = getattr(model, "layer_pattern", None)
    return pattern is not None and "M" in pattern.layers


def stage_cache_spec(model: nn.Module, block_size: int, tp_size: int) -> StageCacheSpec:
    """The attention and Mamba layers of this stage's decoder (global numbers) and their
    TP-local KV / state shapes."""
    attention, mamba = [], []
    for module in model.decoder.modules():
        if isinstance(module, SelfAttention):
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

    @torch.no_grad()
    def forward(self, context: DynamicInferenceContext, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run this stage on ``batch``; on the last stage return ``(logits [T, V] fp32,
        hidden [T, h])`` (hidden: the decoder output the MTP heads take), else None."""
        model = self.model
        ids, positions = batch.token_ids[None], batch.positions[None]  # [1, T]
        hidden = None
        if self.is_first_stage:
            hidden = model.embed(ids, positions)
        else:
            received = torch.empty(
                batch.num_padded_tokens, 1, self.config.hidden_size, dtype=self.config.params_dtype, device=self.device
            )
            dist.recv(received, src=self._stage_rank(self.pp_rank - 1), group=self.pg.pp)
            model.set_input_tensor(received)
        out = model.decoder(hidden, rotary_pos_emb=model.rotary(positions), inference_context=context)
        if not self.is_last_stage:
            dist.send(out.contiguous(), dst=self._stage_rank(self.pp_rank + 1), group=self.pg.pp)
            return None
        return self.logits(out)[:, 0], out[:, 0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits ``[s, b, V]`` of decoder outputs ``hidden [s, b, h]``."""
        local = self.model.vocab_logits(hidden)
        return gather_from_tensor_model_parallel_region(local, self.pg.tp)[..., : self.vocab_size].float()

    def share_from_last_stage(self, value):
        """Every stage gets the last stage's ``value`` (a picklable object of plain values)."""
        if self.pp_size == 1:
            return value
        box = [value if self.is_last_stage else None]
        device = self.device if dist.get_backend(self.pg.pp) == "nccl" else None
        dist.broadcast_object_list(box, src=self._stage_rank(self.pp_size - 1), group=self.pg.pp, device=device)
        return box[0]
