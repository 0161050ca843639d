"""Pure ASGI middleware of the server: body size limit, API key, request counting.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client disconnects pass
through untouched.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from megatron.core.inference.server.errors import APIError
from megatron.core.inference.server.metrics import ServerMetrics


async def _send_error(send: Send, error: APIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class BodyLimitMiddleware:
    """Answers 413 to request bodies over ``max_bytes``, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(
            413, f"request body is larger than {self.max_bytes} bytes; send a smaller request", code="request_too_large"
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, too_large)
        # Read the whole body up front (bounded), then hand it to the app in one message.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_error(send, too_large)
            if not message.get("more_body", False):
                break
        body_message: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body_message
            if body_message is not None:
                message, body_message = body_message, None
                return message
            return await receive()

        await self.app(scope, replay, send)


class ApiKeyMiddleware:
    """Answers 401 to /v1/ requests without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                error = APIError(
                    401,
                    "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                return await _send_error(send, error)
        await self.app(scope, receive, send)


class RequestCounterMiddleware:
    """Counts responses by path (one of ``paths``, else "other") and status into :class:`ServerMetrics`."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, paths: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                path = scope["path"] if scope["path"] in self.paths else "other"
                self.metrics.count_request(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
