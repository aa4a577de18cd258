"""Bounds on what one client can make the server do: the request body's size (413 as soon as it is
known to be too large, before it is read whole), and the CPU work of turning a request into token ids
(chat templates, tokenization and the engine's request check run in a small pool of worker threads,
never on the event loop; when its queue is full a new request gets 429 at once)."""
from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from starlette.exceptions import HTTPException

from sudu.server.errors import APIError


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 4 << 20  # a 32k-token prompt is ~130 KB of text; this leaves 30x room
    prepare_workers: int = 2  # threads that render templates and tokenize
    prepare_queue: int = 64  # requests waiting for such a thread before new ones get 429

    def validate(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be >= 1024")
        if self.prepare_workers < 1 or self.prepare_queue < 0:
            raise ValueError("--prepare-workers must be >= 1 and --prepare-queue >= 0")


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server's limit of {limit} bytes"


class BodySizeLimit:
    """ASGI middleware: a declared Content-Length over the limit is answered 413 before any of the body
    is read; a body that grows past it while streaming in (chunked) ends with the same 413."""

    def __init__(self, app, max_bytes: int, count: Callable[[APIError], None]):
        self.app = app
        self.max_bytes = max_bytes
        self.count = count  # sees each 413 this middleware answers itself (the error metric)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            err = APIError(413, _too_large(self.max_bytes), code="request_too_large")
            self.count(err)
            await _send_413(send, err)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while reading the body on to the app's handler
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)


async def _send_413(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class PoolFull(Exception):
    pass


class PreparePool:
    """Blocking CPU work off the event loop, bounded: `workers` threads, and at most `workers + queue`
    jobs admitted at a time (a job counts until it has really finished, even if its caller has gone)."""

    def __init__(self, workers: int, queue: int):
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="sudu-prepare")
        self.capacity = workers + queue
        self._admitted = 0
        self._lock = threading.Lock()

    @property
    def num_admitted(self) -> int:
        return self._admitted

    def _release(self, _future) -> None:
        with self._lock:
            self._admitted -= 1

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        """fn(*args) on a worker thread; PoolFull at once when the pool holds `capacity` jobs."""
        with self._lock:
            if self._admitted >= self.capacity:
                raise PoolFull
            self._admitted += 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
