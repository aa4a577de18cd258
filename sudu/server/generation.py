"""Fan-in of one call's engine requests: `generate_all` interleaves the outputs of every job (several
prompts of a completions call) as they come, and leaving it early, for any reason, aborts every job in
the engine so its KV blocks return to the pool at once."""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator

import anyio

from sudu.engine.outputs import RequestOutput
from sudu.server.engine_protocol import ServingEngine
from sudu.server.requests import Job

logger = logging.getLogger("sudu.server")

_JOB_DONE = object()


async def _shielded_abort(engine: ServingEngine, request_id: str) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await engine.abort(request_id)
        except Exception:  # noqa: BLE001 -- the request may already be gone
            logger.debug("abort of %s failed", request_id, exc_info=True)


async def _generate_one(engine: ServingEngine, job_index: int, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    finished = False
    outputs = engine.generate(job.request_id, job.request, priority=job.priority)
    try:
        async for out in outputs:
            finished = finished or out.finished
            yield job_index, out
    finally:
        if not finished:
            if hasattr(outputs, "aclose"):
                with anyio.CancelScope(shield=True):
                    await outputs.aclose()
            await _shielded_abort(engine, job.request_id)


async def generate_all(engine: ServingEngine, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(job index, RequestOutput) of every job, interleaved as they come; leaving early aborts them all."""
    if len(jobs) == 1:
        async with aclosing(_generate_one(engine, 0, jobs[0])) as outputs:
            async for item in outputs:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async for item in _generate_one(engine, i, job):
                queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 -- re-raised in the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_JOB_DONE)

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _JOB_DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
