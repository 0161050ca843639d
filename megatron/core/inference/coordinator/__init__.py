"""Serving plumbing: msgpack protocol, ZeroMQ coordinator, engine endpoint and asyncio client."""

from megatron.core.inference.coordinator.client import (
    ClientClosedError,
    ClientStateError,
    InferenceClient,
    RequestHandle,
)
from megatron.core.inference.coordinator.coordinator import (
    CoordinatorStoppedError,
    EngineLostError,
    InferenceCoordinator,
)
from megatron.core.inference.coordinator.engine_endpoint import EngineEndpoint
from megatron.core.inference.coordinator.messages import ControlSignal, MessageKind, ProtocolError
from megatron.core.inference.coordinator.routing import LoadRouter, RoutingError
from megatron.core.inference.errors import DuplicateRequestIdError

__all__ = [
    "ClientClosedError",
    "ClientStateError",
    "ControlSignal",
    "CoordinatorStoppedError",
    "DuplicateRequestIdError",
    "EngineEndpoint",
    "EngineLostError",
    "InferenceClient",
    "InferenceCoordinator",
    "LoadRouter",
    "MessageKind",
    "ProtocolError",
    "RequestHandle",
    "RoutingError",
]
