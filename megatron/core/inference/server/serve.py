"""Running the HTTP server: on a host and port, or on a listening socket the caller already bound.

Every accepted connection gets TCP_NODELAY and a deadline for its request heads (see
:mod:`~megatron.core.inference.server.connections`), whoever made the listening socket.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from megatron.core.errors import MegatronRuntimeError
from megatron.core.inference.coordinator.client import InferenceClient
from megatron.core.inference.server.connections import guarded_http_protocol
from megatron.core.inference.server.openai_api import build_app
from megatron.core.inference.server.service import ServerConfig


class ServerStartError(MegatronRuntimeError):
    """The server thread did not start serving."""


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0 picks a free port), listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def as_app(app_or_engine_client: FastAPI | InferenceClient, **app_options) -> FastAPI:
    """The app itself, or a fresh app serving an engine client (``app_options`` go to ``build_app``)."""
    if isinstance(app_or_engine_client, InferenceClient):
        return build_app(app_or_engine_client, **app_options)
    if app_options:
        raise TypeError(f"app options {sorted(app_options)} only apply when serving an InferenceClient, not an app")
    return app_or_engine_client


def _server(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Server:
    """The uvicorn server of ``app``, with the connection policy of the app's ServerConfig (defaults
    for an app that ``build_app`` did not make)."""
    options = getattr(app.state, "server_config", None) or ServerConfig()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        lifespan="on",
        http=guarded_http_protocol(options.header_timeout_s),
    )
    return uvicorn.Server(config)


def serve(
    app_or_engine_client: FastAPI | InferenceClient,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    *,
    log_level: str = "info",
    **app_options,
) -> None:
    """Serve until interrupted. With ``sock`` (already bound) the server uses it and ``port`` is ignored.

    Binds loopback unless ``host`` says otherwise.
    """
    _server(as_app(app_or_engine_client, **app_options), host, port, log_level).run(sockets=[sock] if sock else None)


class ServerThread:
    """The server in a background thread, on ``sock`` or on a socket bound to ``host:port``.

    ``with ServerThread(app) as server: ... server.url ...``; leaving stops it gracefully.
    """

    def __init__(
        self,
        app_or_engine_client: FastAPI | InferenceClient,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        *,
        log_level: str = "warning",
        **app_options,
    ):
        self.sock = sock if sock is not None else bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.app = as_app(app_or_engine_client, **app_options)
        self.uvicorn_server = _server(self.app, self.host, self.port, log_level)  # its server_state lists connections
        self._thread = threading.Thread(target=self.uvicorn_server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uvicorn_server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServerStartError(f"the server on {self.url} did not start within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.uvicorn_server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
