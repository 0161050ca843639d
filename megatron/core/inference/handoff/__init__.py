"""KV state handoff between a prefill engine and a decode engine (disaggregated serving).

:mod:`metadata` (the handoff record), :mod:`plan` (which bytes move), :mod:`transport` (NIXL and
torch.distributed pulls), :mod:`prefill_side` (pins), :mod:`decode_side` (validation, FIFO
capacity wait, pull, admission into decode), :mod:`failures` (typed errors) and
:mod:`serving` (channel, prefill worker, engine adapter for the coordinator).
"""

from megatron.core.inference.handoff.decode_side import DecodeSide
from megatron.core.inference.handoff.failures import (
    HandoffMetadataError,
    HandoffRejectedError,
    TransferFailedError,
    TransferSubmitError,
)
from megatron.core.inference.handoff.metadata import HandoffRecord, MambaStateDescriptor, SourceLayout
from megatron.core.inference.handoff.prefill_side import Pin, PrefillSide
from megatron.core.inference.handoff.transport import (
    HandoffTransport,
    NixlTransport,
    NixlUnavailableError,
    PullHandle,
    TorchDistributedTransport,
    TransferState,
    TransportError,
    require_nixl,
)

__all__ = [
    "DecodeSide",
    "HandoffMetadataError",
    "HandoffRecord",
    "HandoffRejectedError",
    "HandoffTransport",
    "MambaStateDescriptor",
    "NixlTransport",
    "NixlUnavailableError",
    "Pin",
    "PrefillSide",
    "PullHandle",
    "SourceLayout",
    "TorchDistributedTransport",
    "TransferFailedError",
    "TransferState",
    "TransferSubmitError",
    "TransportError",
    "require_nixl",
]
