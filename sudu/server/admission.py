"""Admission by predicted wait, at the edge: each prepared request is put to the engine's `try_admit`
(engine/wait_predictor.py predicts its time to first token from the queue ahead, its uncached prompt and
the measured speed); a request predicted to wait longer than `--max-queue-wait` is refused with 429 in
OpenAI's shape and a `Retry-After` from the predicted drain time. Counted on /metrics: admitted and
refused requests, and the predicted wait of the admitted ones next to their actual wait (responses.py
observes that at the first token). An engine without `try_admit` (a cluster's) admits by queue length only."""
from __future__ import annotations

import math

from sudu.server.engine_protocol import ServingEngine
from sudu.server.errors import APIError
from sudu.server.metrics import ServerMetrics
from sudu.server.requests import PreparedCall


def overloaded(queue_s: float | None, wait_s: float | None, limit_s: float, retry_after_s: float) -> APIError:
    retry = max(1, math.ceil(retry_after_s))
    if queue_s is None or wait_s is None:
        why = "The server is still measuring its speed and has no free slot now"
    else:
        why = (f"The predicted wait behind other requests is {queue_s:.1f} s (first token in {wait_s:.1f} s), "
               f"over this server's limit of {limit_s:g} s")
    return APIError(429, f"{why}; retry after {retry} s", type="rate_limit_error", code="server_overloaded",
                    headers={"Retry-After": str(retry)})


def admit_by_wait(engine: ServingEngine, metrics: ServerMetrics, prepared: PreparedCall) -> None:
    """Raise 429 unless every engine request of the call is admitted (runs in the worker pool: the
    prompt's cache lookup hashes it)."""
    try_admit = getattr(engine, "try_admit", None)
    if try_admit is None:
        return
    for job in prepared.jobs:
        prediction = try_admit(job.request_id, job.request, job.priority)
        if not prediction.admitted:
            metrics.admission_refused.inc()
            raise overloaded(prediction.queue_s, prediction.wait_s, prediction.limit_s, prediction.retry_after_s)
        if prediction.wait_s is not None:
            metrics.predicted_wait.observe(prediction.wait_s)
    metrics.admission_admitted.inc()
