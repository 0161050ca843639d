"""MIMO: a language model fed with modality embeddings at special token positions.

A modality (e.g. ``"images"``) has a submodule (an encoder plus a projection into the
language model's hidden size) and a special token id. A sample's input ids contain that id
repeated once per embedding the encoder produces for it; the language model's embedding
output at those positions is replaced by the projected encoder output, and the loss of
positions whose label is the special token is zero (nothing to predict there).

On a rank holding only some modules the others are absent (``None`` / missing from
``modality_submodules``); :mod:`schedule` runs such split models, :meth:`MimoModel.forward`
runs the modules of a rank that holds all of them in one autograd graph.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.config import ConfigError
from megatron.core.errors import MegatronInputError
from megatron.core.models.mimo.bridge import EmbeddingBridge, to_language_differentiable
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region


class MimoInputError(MegatronInputError):
    """Inputs that do not fit the model: wrong special-token counts, missing modality inputs."""


class ModalitySubmodule(nn.Module):
    """An encoder and a projection: ``forward(inputs) -> [b, tokens, language hidden]``.
    ``config`` is the encoder's."""

    def __init__(self, encoder: nn.Module, projection: nn.Module):
        super().__init__()
        self.config = encoder.config
        self.encoder = encoder
        self.projection = projection

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.projection(self.encoder(inputs)).transpose(0, 1).contiguous()


def place_modality_embeddings(
    hidden: torch.Tensor, input_ids: torch.Tensor, token_id: int, embeddings: torch.Tensor
) -> torch.Tensor:
    """``hidden`` [s, b, h] with the positions where ``input_ids`` [b, s] equal ``token_id``
    replaced, in order, by ``embeddings`` [b, n, h] (each sample must hold exactly n such ids)."""
    mask = input_ids == token_id
    counts = mask.sum(dim=1)
    expected = embeddings.shape[1]
    wrong = (counts != expected).nonzero().flatten().tolist()
    if wrong:
        raise MimoInputError(
            f"sample(s) {wrong} hold {[int(counts[i]) for i in wrong]} copies of special token {token_id}; "
            f"each sample needs exactly {expected}, one per modality embedding"
        )
    batch_first = hidden.transpose(0, 1)
    placed = batch_first.masked_scatter(mask.unsqueeze(-1), embeddings.to(hidden.dtype))
    return placed.transpose(0, 1).contiguous()


class MimoModel(nn.Module):
    """The language model plus modality submodules.

    Args:
        language_model: a GPTModel or HybridModel (single pipeline stage, built with
            ``scatter_embedding_sequence_parallel=False`` under sequence parallelism), or
            None on ranks that do not hold it.
        modality_submodules: modality name -> :class:`ModalitySubmodule`, for the
            modalities this rank holds.
        special_token_ids: modality name -> its special token id (every modality of the job).

    State-dict keys are ``language_model.*`` and ``modality_submodules.<name>.encoder.*`` /
    ``.projection.*``.
    """

    def __init__(
        self,
        language_model: nn.Module | None,
        modality_submodules: dict[str, ModalitySubmodule],
        special_token_ids: dict[str, int],
    ):
        super().__init__()
        unknown = sorted(set(modality_submodules) - set(special_token_ids))
        if unknown:
            raise ConfigError(f"modalities {unknown} have no special token id; give one in special_token_ids")
        if len(set(special_token_ids.values())) != len(special_token_ids):
            raise ConfigError(f"special token ids must be distinct, got {special_token_ids}")
        if language_model is not None:
            self._check_language_model(language_model)
        self.language_model = language_model
        self.modality_submodules = nn.ModuleDict(modality_submodules)
        self.special_token_ids = dict(special_token_ids)

    @staticmethod
    def _check_language_model(language_model: nn.Module) -> None:
        if not (language_model.pre_process and language_model.post_process):
            raise ConfigError("the MIMO language model must be a single pipeline stage (pre_process and post_process)")
        if language_model.config.sequence_parallel and language_model.embedding.scatter_to_sequence_parallel:
            raise ConfigError(
                "under sequence_parallel the MIMO language model must be built with "
                "scatter_embedding_sequence_parallel=False (modality embeddings are placed before the scatter)"
            )

    def encode(self, modality_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Projected embeddings ``[b, tokens, language hidden]`` of each modality this rank holds."""
        missing = sorted(set(self.modality_submodules) - set(modality_inputs))
        if missing:
            raise MimoInputError(f"no inputs given for modalities {missing}; got {sorted(modality_inputs)}")
        return {name: module(modality_inputs[name]) for name, module in self.modality_submodules.items()}

    def language_forward(
        self,
        input_ids: torch.Tensor,
        modality_embeddings: dict[str, torch.Tensor],
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The language model on text with modality embeddings placed at their special tokens:
        per-token loss [b, s] (zero where the label is a special token) with ``labels``, else logits."""
        lm = self.language_model
        if lm is None:
            raise MimoInputError("this rank does not hold the language model")
        position_ids = lm.position_ids_for(input_ids, position_ids, labels)
        hidden = lm.embed(input_ids, position_ids)
        for name, token_id in self.special_token_ids.items():
            if name not in modality_embeddings:
                raise MimoInputError(f"no embeddings given for modality {name!r}; got {sorted(modality_embeddings)}")
            hidden = place_modality_embeddings(hidden, input_ids, token_id, modality_embeddings[name])
        if lm.config.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, lm.pg_collection.tp)
        output = lm(input_ids, position_ids, labels=labels, decoder_input=hidden)
        if labels is None:
            return output
        special = torch.zeros_like(labels, dtype=torch.bool)
        for token_id in self.special_token_ids.values():
            special |= labels == token_id
        return output.masked_fill(special, 0.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        modality_inputs: dict[str, torch.Tensor],
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        bridges: dict[str, EmbeddingBridge] | None = None,
    ) -> torch.Tensor:
        """Encode, move and place every modality in one autograd graph (a rank holding every
        module). Without ``bridges`` the encoder's batch is the language model's batch."""
        embeddings = self.encode(modality_inputs)
        if bridges is not None:
            embeddings = {name: to_language_differentiable(bridges[name], emb) for name, emb in embeddings.items()}
        return self.language_forward(input_ids, embeddings, position_ids, labels)
