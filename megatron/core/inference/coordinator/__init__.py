"""Serving plumbing: msgpack protocol, ZeroMQ coordinator, engine endpoint and asyncio client."""

from megatron.core.inference.coordinator.auth import ControlPlaneKeyError, ControlPlaneKeys, Role, launch_keys
from megatron.core.inference.coordinator.client import (
    ClientClosedError,
    ClientStateError,
    CoordinatorLostError,
    InferenceClient,
    RequestHandle,
    ServingHealth,
)
from megatron.core.inference.coordinator.coordinator import (
    CoordinatorConfigError,
    CoordinatorStoppedError,
    EngineLostError,
    InferenceCoordinator,
    MalformedOutputError,
    NoEngineAvailableError,
    RequestTimeoutError,
    WaitingQueueFullError,
)
from megatron.core.inference.coordinator.engine_endpoint import EngineEndpoint
from megatron.core.inference.coordinator.messages import ControlSignal, EngineStoppingError, MessageKind, ProtocolError
from megatron.core.inference.coordinator.routing import LoadRouter, RoutingError
from megatron.core.inference.errors import DuplicateRequestIdError

__all__ = [
    "ClientClosedError",
    "ClientStateError",
    "ControlPlaneKeyError",
    "ControlPlaneKeys",
    "ControlSignal",
    "CoordinatorConfigError",
    "CoordinatorLostError",
    "CoordinatorStoppedError",
    "DuplicateRequestIdError",
    "EngineEndpoint",
    "EngineLostError",
    "EngineStoppingError",
    "InferenceClient",
    "InferenceCoordinator",
    "LoadRouter",
    "MalformedOutputError",
    "MessageKind",
    "NoEngineAvailableError",
    "ProtocolError",
    "RequestHandle",
    "RequestTimeoutError",
    "Role",
    "RoutingError",
    "ServingHealth",
    "WaitingQueueFullError",
    "launch_keys",
]
