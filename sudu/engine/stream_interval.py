"""How a request's outputs are handed to its consumer (the HTTP handler, or a Ray replica's stream).

The engine thread queues one delta per step for each request. What the consumer takes as one item:
  * every output already waiting when it asks, joined (it fell behind: one item costs it less than
    several, and nothing waits for it);
  * with a stream interval N > 1, after the first token, outputs are held until one choice carries N
    new tokens, the request finishes or fails. Each item costs the consumer a wakeup and, on Ray Serve,
    a message between processes with its threads' wakeups on both sides; on a machine whose cores the
    engine keeps busy, N > 1 gives that time back to decoding, and tokens arrive in bursts of N
    (vLLM's and SGLang's --stream-interval make the same trade). The first token is never held: TTFT
    does not change."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sudu.engine.outputs import RequestOutput


async def coalesced(queue: asyncio.Queue, interval: int) -> AsyncIterator[RequestOutput]:
    """The outputs (or an exception, which ends the stream after what came before it) put on queue,
    joined as above, until the one that finishes the request."""
    pending: RequestOutput | None = None
    sent_a_token = False
    while True:
        item = await queue.get()
        while True:
            if isinstance(item, BaseException):
                if pending is not None:
                    yield pending
                raise item
            pending = item if pending is None else pending.then(item)
            if pending.finished or queue.empty():
                break
            item = queue.get_nowait()
        if pending.finished or not sent_a_token or pending.most_new_tokens >= interval:  # a failed request is finished
            sent_a_token = sent_a_token or pending.most_new_tokens > 0
            out, pending = pending, None
            yield out
            if out.finished:
                return
