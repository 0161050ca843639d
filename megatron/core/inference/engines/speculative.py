"""Speculative decoding with the model's multi-token-prediction (MTP) heads.

After a request samples token ``x[t+1]`` from the main model's row at position ``t``, MTP depth
1 takes ``(embedding(x[t+1]), hidden[t])`` and proposes ``d1 = x[t+2]``; depth ``k`` takes the
previous depth's draft and hidden state (as in training, slot ``t`` keeps position ``t``). The
next step computes ``x[t+1], d1 .. dk`` together; the engine samples at each position in turn
and accepts drafts while they equal the sampled token, so outputs (greedy or seeded) are
exactly those of plain decoding, and every emitted token draws exactly one random number.
Rejected drafts are dropped from the context and their KV positions rewound
(:meth:`DynamicInferenceContext.resolve_draft_tokens`); their blocks came from the
``lookahead`` page reason.

The MTP depths keep no KV cache: each runs on the request's newest position alone (its
attention sees only that position). Drafts are proposals, so this only affects how many are
accepted, never the outputs.
"""

from __future__ import annotations

import torch

from megatron.core.inference.engines.errors import EngineConfigError
from megatron.core.inference.model_runner import ModelRunner, model_is_hybrid


class MTPDrafter:
    """Proposes ``num_speculative_tokens`` drafts per request with the MTP depths of the last
    pipeline stage's model."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int):
        model = runner.model
        num_depths = model.config.mtp_num_layers or 0
        if num_speculative_tokens > num_depths:
            raise EngineConfigError(
                f"num_speculative_tokens={num_speculative_tokens} needs that many MTP depths, but the model has "
                f"mtp_num_layers={num_depths}; use at most {num_depths}"
            )
        if model_is_hybrid(model):
            raise EngineConfigError(
                "speculative decoding is not supported for models with Mamba layers (their state cannot be "
                "rewound past rejected drafts); use num_speculative_tokens=0"
            )
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens

    @torch.no_grad()
    def propose(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, num_drafts: int
    ) -> torch.Tensor:
        """Greedy drafts ``[R, num_drafts]`` after ``tokens [R]`` sampled from the main model's
        rows ``hidden [R, h]`` at ``positions [R]`` (last pipeline stage only)."""
        model = self.runner.model
        position_ids = positions[:, None]  # [b=R, s=1]: each request attends to itself alone
        rotary = model.rotary(position_ids)
        state = hidden[None]  # [s=1, b=R, h]
        drafts = []
        for layer in model.mtp.layers[:num_drafts]:
            embedded = model.embed(tokens[:, None], position_ids)
            state = layer(embedded, state, rotary_pos_emb=rotary)
            tokens = self.runner.logits(state)[0].argmax(dim=-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)
