"""An independent per-token MoE reference (a loop over tokens and their chosen experts)."""

from __future__ import annotations

import torch


def moe_reference(layer, hidden: torch.Tensor) -> torch.Tensor:
    """``sum_j p_j * expert_j(x)`` for each token, from the layer's own router decision and the
    dense weights of every expert (``layer`` holds all experts)."""
    config = layer.config
    tokens = hidden.reshape(-1, hidden.shape[-1])
    probs, expert_of_slot = layer.router(tokens, seq_length=hidden.shape[0])
    experts = layer.experts
    rows = []
    for t, x in enumerate(tokens):
        acc = torch.zeros_like(x)
        for p, e in zip(probs[t], expert_of_slot[t].tolist(), strict=True):
            if e == config.num_moe_experts:
                continue
            h = x @ experts.weight1[e]
            if experts.bias1 is not None:
                h = h + experts.bias1[e]
            if config.gated_linear_unit:
                gate, up = h.chunk(2)
                h = config.activation_func(gate) * up
            else:
                h = config.activation_func(h)
            y = h @ experts.weight2[e]
            if experts.bias2 is not None:
                y = y + experts.bias2[e]
            acc = acc + p * y
        rows.append(acc)
    return torch.stack(rows).view_as(hidden)
