"""Forward and backward of a MIMO model over the micro-batches of one global batch.

Every rank runs the same sequence per micro-batch, doing only its modules' parts:

1. modality ranks encode their micro-batch;
2. each bridge moves the embeddings to the language-model ranks (:meth:`to_language`);
3. language-model ranks compute the loss with the embeddings as leaves and back-propagate
   ``loss / num_microbatches`` (times the loss scale), keeping the leaves' gradients;
4. each bridge moves those gradients back (:meth:`to_encoder`);
5. modality ranks back-propagate them through their encoders.

The same code serves colocated modules (steps 2 and 4 are then mostly local copies) and
modules on disjoint ranks. There is no pipelining between the modules. Every micro-batch but
the last runs inside ``no_sync()`` when given (the DDP wrappers' ``no_sync``), so gradient
reductions overlapped with backward start only once the gradients are complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch

from megatron.core.models.mimo.bridge import EmbeddingBridge
from megatron.core.models.mimo.mimo_model import MimoModel


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_token_loss`` [b, s] over the positions where ``loss_mask`` is 1."""
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1)


def _microbatch(
    model: MimoModel,
    bridges: dict[str, EmbeddingBridge],
    language_batches: Iterator[dict] | None,
    modality_batches: dict[str, Iterator[dict]],
    num_microbatches: int,
    forward_only: bool,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor | None:
    """Steps 1-5 for one micro-batch; its mean loss on language-model ranks, else None."""
    encoded = model.encode({name: next(modality_batches[name])[name] for name in model.modality_submodules})
    received = {name: bridges[name].to_language(encoded.get(name)) for name in sorted(bridges)}
    grads = {name: None for name in bridges}
    loss = None
    if model.language_model is not None:
        leaves = {name: emb.requires_grad_(not forward_only) for name, emb in received.items()}
        batch = next(language_batches)
        per_token = model.language_forward(batch["tokens"], leaves, batch["position_ids"], batch["labels"])
        loss = masked_mean_loss(per_token, batch["loss_mask"])
        if not forward_only:
            scaled = loss / num_microbatches
            (grad_scale_func(scaled) if grad_scale_func is not None else scaled).backward()
            grads = {name: leaf.grad for name, leaf in leaves.items()}
    if not forward_only:
        for name in sorted(bridges):
            encoder_grad = bridges[name].to_encoder(grads[name])
            if name in encoded:
                encoded[name].backward(encoder_grad)
    return None if loss is None else loss.detach()


def forward_backward(
    model: MimoModel,
    bridges: dict[str, EmbeddingBridge],
    language_batches: Iterator[dict] | None,
    modality_batches: dict[str, Iterator[dict]],
    num_microbatches: int,
    *,
    forward_only: bool = False,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
    no_sync: Callable[[], AbstractContextManager] | None = None,
) -> list[torch.Tensor]:
    """Run ``num_microbatches`` micro-batches; return their mean losses on language-model
    ranks (an empty list elsewhere).

    ``language_batches`` yields dicts with ``tokens``, ``position_ids``, ``labels`` and
    ``loss_mask`` [b, s] (None on ranks without the language model); ``modality_batches[name]``
    yields dicts holding the modality's input under ``name`` (only for modalities this rank holds).
    ``no_sync`` (a context-manager factory) encloses every micro-batch but the last.
    """
    losses = []
    with torch.set_grad_enabled(not forward_only):
        for index in range(num_microbatches):
            accumulate_only = no_sync is not None and not forward_only and index < num_microbatches - 1
            with no_sync() if accumulate_only else nullcontext():
                loss = _microbatch(
                    model, bridges, language_batches, modality_batches, num_microbatches, forward_only, grad_scale_func
                )
            if loss is not None:
                losses.append(loss)
    return losses
