"""Moving per-sample modality embeddings between an encoder's data shards and the language
model's, and their gradients back, with point-to-point messages.

Each micro-step covers ``M`` consecutive samples. The language model's data shard ``q``
(of ``Wl`` = |dp_cp_gtp| shards) holds samples ``[q*ml, (q+1)*ml)`` with ``ml = M / Wl``;
the encoder's shard ``k`` holds ``[k*me, (k+1)*me)``, ``me = M / We``. Forward: the root
(TP rank 0) of every encoder shard sends each language rank that needs them (all its TP
peers) the embeddings of the samples they share. Backward: the root of every language
shard sends the gradients of those samples back to every encoder rank holding them (all
encoder TP peers back-propagate the same gradient). Works the same whether the modules
are colocated (messages to oneself become copies) or on disjoint ranks.

Gradient scale: each language shard back-propagates the mean loss of its own samples and
DDP averages over ``Wl`` shards; the encoder's DDP and GTP reductions average over ``We``
shards instead, so the gradients handed to the encoder are multiplied by ``We / Wl``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.errors import MegatronInputError
from megatron.core.models.mimo.roles import data_index, data_width, is_model_root
from megatron.core.process_groups import RankLayout


class BridgeError(MegatronInputError):
    """Module layouts or tensors the bridge cannot connect; the message names the sizes."""


@dataclass(frozen=True)
class Route:
    """Samples ``[src_start, src_start + count)`` of rank ``src``'s micro-batch go to
    ``[dst_start, dst_start + count)`` of rank ``dst``'s."""

    src: int
    dst: int
    src_start: int
    dst_start: int
    count: int


def _routes(
    src_layout: RankLayout, src_mbs: int, src_all: bool, dst_layout: RankLayout, dst_mbs: int, dst_all: bool
) -> list[Route]:
    """Routes from the senders of ``src_layout`` (every rank, or shard roots only) to the
    receivers of ``dst_layout`` (every rank, or shard roots only), sample ranges intersected."""
    routes = []
    for src in src_layout.ranks:
        if not (src_all or is_model_root(src_layout, src)):
            continue
        src_lo = data_index(src_layout, src) * src_mbs
        for dst in dst_layout.ranks:
            if not (dst_all or is_model_root(dst_layout, dst)):
                continue
            dst_lo = data_index(dst_layout, dst) * dst_mbs
            lo, hi = max(src_lo, dst_lo), min(src_lo + src_mbs, dst_lo + dst_mbs)
            if lo < hi:
                routes.append(Route(src, dst, lo - src_lo, lo - dst_lo, hi - lo))
    return routes


class EmbeddingBridge:
    """Transport of one modality's embeddings ``[mbs, tokens, hidden]`` (batch first).

    Args:
        encoder_layout, language_layout: the two modules' grids (PP 1).
        language_micro_batch_size: samples per language-model micro-batch.
        sample_shape: ``(tokens, hidden)`` of one sample's embeddings.
        dtype, device: of the embeddings on the wire.
        group: the process group spanning both modules (default: the world); ranks are global.
    """

    def __init__(
        self,
        encoder_layout: RankLayout,
        language_layout: RankLayout,
        language_micro_batch_size: int,
        sample_shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        group=None,
    ):
        self.encoder_layout, self.language_layout = encoder_layout, language_layout
        self.language_micro_batch_size = language_micro_batch_size
        samples = language_micro_batch_size * data_width(language_layout)
        if language_micro_batch_size < 1 or samples % data_width(encoder_layout):
            raise BridgeError(
                f"the {samples} samples of a micro-step (micro-batch {language_micro_batch_size} x "
                f"{data_width(language_layout)} language data shards) must split evenly over the encoder's "
                f"{data_width(encoder_layout)} data shards"
            )
        self.encoder_micro_batch_size = samples // data_width(encoder_layout)
        self.grad_scale = data_width(encoder_layout) / data_width(language_layout)
        self.sample_shape = tuple(sample_shape)
        self.dtype, self.device, self.group = dtype, torch.device(device), group
        self.forward_routes = _routes(
            encoder_layout, self.encoder_micro_batch_size, False, language_layout, language_micro_batch_size, True
        )
        self.backward_routes = _routes(
            language_layout, language_micro_batch_size, False, encoder_layout, self.encoder_micro_batch_size, True
        )

    def _exchange(self, routes: list[Route], local: torch.Tensor | None, out_rows: int | None) -> torch.Tensor | None:
        """Send this rank's routed rows of ``local`` and receive its rows of a new
        ``[out_rows, *sample_shape]`` tensor (None when this rank receives nothing)."""
        me = dist.get_rank()
        out = None
        if out_rows is not None:
            out = torch.empty((out_rows, *self.sample_shape), dtype=self.dtype, device=self.device)
        requests, recv_rows = [], 0
        for route in routes:
            if route.src == me:
                rows = local[route.src_start : route.src_start + route.count].detach()
                if route.dst == me:
                    out[route.dst_start : route.dst_start + route.count].copy_(rows)
                    recv_rows += route.count
                else:
                    payload = rows.to(self.dtype).contiguous()
                    requests.append(dist.isend(payload, route.dst, group=self.group))
            elif route.dst == me:
                view = out[route.dst_start : route.dst_start + route.count]
                requests.append(dist.irecv(view, route.src, group=self.group))
                recv_rows += route.count
        for request in requests:
            request.wait()
        if out is not None and recv_rows != out_rows:
            raise BridgeError(f"rank {me} received {recv_rows} of its {out_rows} samples; the layouts do not match")
        return out

    def _check(self, tensor: torch.Tensor, rows: int, what: str) -> None:
        expected = (rows, *self.sample_shape)
        if tuple(tensor.shape) != expected:
            raise BridgeError(f"{what} must have shape {list(expected)} (batch first), got {list(tensor.shape)}")

    def to_language(self, encoder_embeddings: torch.Tensor | None) -> torch.Tensor | None:
        """Forward transport. Encoder ranks pass their embeddings, others None; language-model
        ranks get their micro-batch's embeddings ``[ml, tokens, hidden]`` (detached), others None."""
        me = dist.get_rank()
        if me in self.encoder_layout.ranks:
            if encoder_embeddings is None:
                raise BridgeError(f"rank {me} holds the encoder and must pass its embeddings to to_language")
            self._check(encoder_embeddings, self.encoder_micro_batch_size, "encoder embeddings")
        rows = self.language_micro_batch_size if me in self.language_layout.ranks else None
        return self._exchange(self.forward_routes, encoder_embeddings, rows)

    def to_encoder(self, language_grads: torch.Tensor | None) -> torch.Tensor | None:
        """Backward transport. Language-model ranks pass the gradient of the embeddings they
        received (only shard roots' are sent), others None; encoder ranks get the gradient of
        their embeddings, already multiplied by :attr:`grad_scale`, others None."""
        me = dist.get_rank()
        if me in self.language_layout.ranks:
            if language_grads is None:
                raise BridgeError(f"rank {me} holds the language model and must pass gradients to to_encoder")
            self._check(language_grads, self.language_micro_batch_size, "language-model gradients")
        rows = self.encoder_micro_batch_size if me in self.encoder_layout.ranks else None
        grads = self._exchange(self.backward_routes, language_grads, rows)
        return None if grads is None else grads.mul_(self.grad_scale)


class _ToLanguage(torch.autograd.Function):
    """Forward: :meth:`EmbeddingBridge.to_language`; backward: :meth:`EmbeddingBridge.to_encoder`.
    Only for ranks that hold both modules (every rank joins both exchanges)."""

    @staticmethod
    def forward(ctx, bridge: EmbeddingBridge, encoder_embeddings: torch.Tensor) -> torch.Tensor:
        ctx.bridge = bridge
        return bridge.to_language(encoder_embeddings)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, ctx.bridge.to_encoder(grad.contiguous())


def to_language_differentiable(bridge: EmbeddingBridge, encoder_embeddings: torch.Tensor) -> torch.Tensor:
    """:meth:`EmbeddingBridge.to_language` inside one autograd graph (colocated modules)."""
    return _ToLanguage.apply(bridge, encoder_embeddings)
