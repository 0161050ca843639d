"""Weight initializers derived from a TransformerConfig (normal, and scaled for output projections)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from megatron.core.config import TransformerConfig


def init_method(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, init_method_std), in place."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=config.init_method_std)


def output_layer_init_method(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init of projections that write into the residual stream: std / sqrt(2 * num_layers)
    when ``apply_scaled_init_to_output_layers`` (GPT-2), else the plain init."""
    if not config.apply_scaled_init_to_output_layers:
        return init_method(config)
    std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)
