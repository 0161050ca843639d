"""What the server does with each TCP connection, below HTTP: no Nagle delay, and a deadline
for every request head.

uvicorn sets TCP_NODELAY only on sockets it creates itself (asyncio does it for sockets made
with ``IPPROTO_TCP``); a listening socket handed over by the caller may have been made with
protocol 0, and then every small keep-alive response waits ~40 ms for a delayed ACK. uvicorn
also has no deadline for a request head: a client that sends half a request line holds its
connection forever (its keep-alive timeout covers only idle connections). The body has its
own deadline in :class:`~megatron.core.inference.server.middleware.BodyLimitMiddleware`.
"""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def set_nodelay(transport: asyncio.Transport) -> None:
    """Turn Nagle's algorithm off on a TCP transport (a no-op for other sockets)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _ConnectionGuard:
    """Mixed in before uvicorn's HTTP protocol class (see :func:`guarded_http_protocol`).

    The request head must be complete ``header_timeout_s`` after the connection opened or
    after the previous response ended; otherwise the connection is closed. A head is complete
    when uvicorn has started a new request cycle (``self.cycle`` changed).
    """

    header_timeout_s: float

    def connection_made(self, transport: asyncio.Transport) -> None:
        set_nodelay(transport)
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_deadline is not None and self.cycle is not self._cycle_before_head:
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        # Armed before uvicorn starts a pipelined request (which changes ``self.cycle``).
        if not self.transport.is_closing():
            self._arm_head_deadline()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._cycle_before_head = self.cycle
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_deadline_passed)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_deadline_passed(self) -> None:
        self._head_deadline = None
        if self.cycle is self._cycle_before_head and not self.transport.is_closing():
            self.transport.close()


def guarded_http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (h11, or httptools when installed) with TCP_NODELAY on every
    accepted connection and a ``header_timeout_s`` deadline for each request head."""
    return type("GuardedHTTPProtocol", (_ConnectionGuard, AutoHTTPProtocol), {"header_timeout_s": header_timeout_s})
