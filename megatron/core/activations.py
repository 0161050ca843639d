"""Activation functions of the models, defined once so configs can name them (see
``TransformerConfig.to_dict`` / ``from_dict``) and HF mappings can refer to them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's "gelu_new")."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (NemotronH's ``relu2`` MLP activation)."""
    return F.relu(x).square()


# Name in a saved config -> function. Names are stable: checkpoints store them.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "silu": F.silu,
    "relu": F.relu,
    "squared_relu": squared_relu,
}
