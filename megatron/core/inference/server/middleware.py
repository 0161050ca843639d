"""Pure ASGI middleware of the server: body size and time limits, API key, request counting.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client disconnects pass
through untouched.
"""

from __future__ import annotations

import asyncio
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from megatron.core.inference.server.errors import APIError
from megatron.core.inference.server.metrics import ServerMetrics
from megatron.core.inference.server.streaming import CLIENT_CLOSED_REQUEST

# Outside /v1/, the routes that read the tokenizer on the client's behalf need the key too.
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})


async def _send_error(send: Send, error: APIError, *, close: bool = False) -> None:
    """Send ``error`` as the whole response; ``close`` asks the server to close the connection after it."""
    response = error.response()
    headers = response.raw_headers + ([(b"connection", b"close")] if close else [])
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


class BodyLimitMiddleware:
    """Reads each request body whole before the app runs, within limits: 413 for a body over
    ``max_bytes`` (declared or streamed), 408 for one not complete within ``timeout_s`` (a
    client that sends its body slowly or never holds no connection for long: the server closes
    it after the 408)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(
            413, f"request body is larger than {self.max_bytes} bytes; send a smaller request", code="request_too_large"
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, too_large, close=True)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client left before sending its body
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        return await _send_error(send, too_large, close=True)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            too_slow = APIError(
                408,
                f"the request body did not arrive within {self.timeout_s}s; send it at once",
                code="request_timeout",
            )
            return await _send_error(send, too_slow, close=True)
        body_message: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body_message
            if body_message is not None:
                message, body_message = body_message, None
                return message
            return await receive()

        await self.app(scope, replay, send)


class ApiKeyMiddleware:
    """Answers 401 to /v1/ requests and /tokenize, /detokenize without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in PROTECTED_PATHS):
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
    """Counts every HTTP request once into :class:`ServerMetrics`: by path (one of ``paths``, else
    "other") and status, a 500 for an error that escaped the app included, and as abandoned
    when its client left before the whole response was sent (such a request is counted with
    the status it was answered, or 499 when it got none)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, paths: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: int | None = None
        complete = abandoned = False

        async def watching_receive() -> Message:
            nonlocal abandoned
            message = await receive()
            abandoned |= message["type"] == "http.disconnect" and not complete
            return message

        async def counting_send(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                complete = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, watching_receive, counting_send)
        finally:
            if status is None:
                status = CLIENT_CLOSED_REQUEST if abandoned else 500
            path = scope["path"] if scope["path"] in self.paths else "other"
            self.metrics.count_request(path, status, abandoned=abandoned)
