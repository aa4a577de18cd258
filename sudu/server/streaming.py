"""Delivery and disconnects: the SSE response (its generator closed on every exit, so a client that goes
away between two chunks aborts its engine request at once), and the race of a non-streaming call
against the client's `http.disconnect`."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sudu.server.errors import failed_call


class _SSEResponse(StreamingResponse):
    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse(body: AsyncIterator[bytes]) -> StreamingResponse:
    return _SSEResponse(body, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work, draining) -> Response:
    """Run a non-streaming call, aborting it (and so freeing its KV blocks) if the client goes away.
    draining() says whether the server is shutting down (a failure then is a 503)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # the client is gone; nobody reads this
    exc = task.exception()
    if exc is not None:
        raise failed_call(exc, draining())
    return task.result()
