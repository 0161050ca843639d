"""HTTP plumbing for long requests: disconnect watching and a server-sent-events response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its response


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the HTTP client leaves first, cancel it and wait until it has cleaned up
    (its cleanup aborts the engine requests), then answer 499 (which nobody reads, but which
    the request counters see)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        # Also when this coroutine itself is cancelled: the work is never left running.
        await asyncio.wait({task, watcher})
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


class EventStreamResponse(StreamingResponse):
    """SSE response that also watches for the client leaving and then closes the body stream;
    ``on_close`` runs once the stream is over either way (also when it never started)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None]):
        super().__init__(content)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
            await self.body_iterator.aclose()
        finally:
            self._on_close()
