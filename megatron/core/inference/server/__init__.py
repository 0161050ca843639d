"""OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of the coordinator client."""

from megatron.core.inference.server.errors import APIError
from megatron.core.inference.server.openai_api import build_app
from megatron.core.inference.server.serve import ServerStartError, ServerThread, as_app, bind_socket, serve
from megatron.core.inference.server.service import ServerConfig, ServerConfigError

__all__ = [
    "APIError",
    "ServerConfig",
    "ServerConfigError",
    "ServerStartError",
    "ServerThread",
    "as_app",
    "bind_socket",
    "build_app",
    "serve",
]
