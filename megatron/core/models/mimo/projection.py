"""Projection of encoder outputs into the language model's hidden size."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.config import TransformerConfig
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_rng_scope
from megatron.core.transformer.init_methods import init_method


class MultimodalProjection(nn.Module):
    """Two-layer MLP ``Row(gelu(Column(x)))`` from ``input_size`` to ``output_size``,
    ``forward(x [n, b, input_size]) -> [n, b, output_size]`` (whole on every TP rank).

    ``config`` is the encoder's (its TP/GTP layout and init seed); the inner width is
    ``config.ffn_hidden_size``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        input_size: int,
        output_size: int,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        self.config = config
        pg_collection = resolve_pg_collection(pg_collection)
        with init_rng_scope(config, "projection_fc1"):
            self.linear_fc1 = ColumnParallelLinear(
                input_size,
                config.ffn_hidden_size,
                config=config,
                init_method=init_method(config),
                bias=True,
                gather_output=False,
                pg_collection=pg_collection,
            )
        with init_rng_scope(config, "projection_fc2"):
            self.linear_fc2 = RowParallelLinear(
                config.ffn_hidden_size,
                output_size,
                config=config,
                init_method=init_method(config),
                bias=True,
                input_is_parallel=True,
                pg_collection=pg_collection,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(torch.nn.functional.gelu(hidden))
        return out
