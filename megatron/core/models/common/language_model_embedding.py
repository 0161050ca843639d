"""Token (+ learned absolute position) embedding of a language model, output [s, b, h]."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import VocabParallelEmbedding, init_rng_scope, scatter_to_sequence_parallel_region
from megatron.core.transformer.dropout import dropout
from megatron.core.transformer.init_methods import init_method
from megatron.core.transformer.norms import mark_replicated

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")


def check_position_embedding_type(position_embedding_type: str) -> None:
    if position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ConfigError(
            f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, got {position_embedding_type!r}"
        )


class LanguageModelEmbedding(nn.Module):
    """Vocabulary-parallel word embedding (``init_rng_scope(config, "embedding")``) plus, for
    ``learned_absolute``, a replicated position table (``"position_embedding"``).

    ``forward(input_ids [b, s], position_ids [b, s]) -> [s, b, h]``, scattered over the
    sequence (``[s/tp, b, h]``) under sequence parallelism when
    ``scatter_to_sequence_parallel``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        scatter_to_sequence_parallel: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        check_position_embedding_type(position_embedding_type)
        self.config = config
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        with init_rng_scope(config, "embedding"):
            self.word_embeddings = VocabParallelEmbedding(
                vocab_size,
                config.hidden_size,
                config=config,
                init_method=init_method(config),
                pg_collection=self.pg_collection,
            )
        self.position_embeddings = None
        if position_embedding_type == "learned_absolute":
            with init_rng_scope(config, "position_embedding"):
                table = torch.empty(max_sequence_length, config.hidden_size, dtype=torch.float32)
                if config.perform_initialization:
                    init_method(config)(table)
                else:
                    table.zero_()
            self.position_embeddings = nn.Embedding(
                max_sequence_length, config.hidden_size, _weight=table.to(config.params_dtype)
            )
            mark_replicated(self.position_embeddings.weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()
        sequence_parallel = self.config.sequence_parallel and self.scatter_to_sequence_parallel
        if sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings, self.pg_collection.tp)
        return dropout(embeddings, self.config.hidden_dropout, self.training, sharded_over_tp=sequence_parallel)
