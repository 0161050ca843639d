"""Feed-forward block: column-parallel fc1, activation (GELU, or SwiGLU when gated), row-parallel fc2.

fc1's bias is applied by the activation (:func:`megatron.core.fusions.activations.activation`:
bias, activation and gate fused on CUDA); fc2's is returned for the layer's bias-dropout-add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.core.activations import gelu_tanh  # noqa: F401 - re-exported for importers of mlp
from megatron.core.config import TransformerConfig
from megatron.core.fusions.activations import activation
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megatron.core.transformer.init_methods import init_method, output_layer_init_method
from megatron.core.transformer.spec import build_module


@dataclass
class MLPSubmodules:
    linear_fc1: Any = ColumnParallelLinear
    linear_fc2: Any = RowParallelLinear


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``; with ``config.gated_linear_unit`` fc1 packs [gate; up] and the
    hidden is ``act(gate) * up`` (SwiGLU when the activation is silu).
    ``forward(hidden [s, b, h]) -> (out [s, b, h], fc2 bias or None)``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        ffn_hidden_size: int | None = None,
    ):
        super().__init__()
        submodules = submodules or MLPSubmodules()
        pg_collection = resolve_pg_collection(pg_collection)
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        self.config = config
        self.gated = config.gated_linear_unit
        self.activation_func = config.activation_func
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            config.hidden_size,
            2 * ffn if self.gated else ffn,
            config=config,
            init_method=init_method(config),
            bias=config.add_bias_linear,
            gather_output=False,
            skip_bias_add=True,
            output_partition_sizes=[ffn, ffn] if self.gated else None,
            pg_collection=pg_collection,
        )
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            ffn,
            config.hidden_size,
            config=config,
            init_method=output_layer_init_method(config),
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            pg_collection=pg_collection,
        )

    def forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        return self.linear_fc2(activation(intermediate, bias, self.activation_func, self.gated))


def call_mlp(module: nn.Module, hidden_states: torch.Tensor, part: str):
    """``module(hidden_states)`` for an MLP-like module returning ``(out, bias or None)``; in
    training, when selective recompute covers ``part`` (of ``--recompute-modules``), its
    activations are recomputed in backward instead, and the bias (a parameter, which a checkpoint
    must not hand out as its own output) is added inside: ``(out + bias, None)``."""
    if not (module.training and module.config.recomputes(part)):
        return module(hidden_states)

    def with_bias(x: torch.Tensor) -> torch.Tensor:
        out, bias = module(x)
        return out if bias is None else out + bias

    return checkpoint(with_bias, hidden_states), None
