"""The OpenAI-compatible HTTP server: `build_app(engine)` makes the FastAPI app (routes, SSE streaming,
OpenAI-style errors, auth, metrics); `make_server(app, ...)` runs it under uvicorn with a graceful drain.

Request path: pydantic validates the body -> the chat template is rendered and tokenized here ->
`engine.generate` (the engine loop runs in its own thread) yields per-step deltas -> they leave as SSE
chunks or are gathered into one JSON body. Every early exit (client gone, error, shutdown) aborts the
engine request so its KV blocks return to the pool."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from sudu.errors import RequestTooLongError, SuduError
from sudu.sampling import SamplingParams
from sudu.server import protocol as P
from sudu.server.metrics import ServerMetrics

logger = logging.getLogger("sudu.server")

GREEDY_TEMPERATURE = 1e-5  # below this, temperature is treated as 0 (logits / ~0 overflow)
MAX_CHOICES_PER_REQUEST = 256  # prompts x n of one /v1/completions call
RETRY_AFTER_S = 1
_LOGPROB_FLOOR = -9999.0  # -inf is not valid JSON


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@dataclass
class ServerState:
    engine: Any | None
    served_model_name: str | None
    api_key: str | None
    shutdown_timeout_s: float
    metrics: ServerMetrics
    load_engine: Callable[[], Any] | None = None
    on_load_error: Callable[[BaseException], None] | None = None
    load_error: str | None = None
    draining: bool = False
    drained: asyncio.Event | None = None
    load_task: asyncio.Task | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.engine.model_name


# ---------------------------------------------------------------- app factory


def build_app(
    engine: Any | None = None,
    *,
    load_engine: Callable[[], Any] | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_timeout_s: float = 30.0,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An app serving `engine` (started in the app's lifespan), or the engine `load_engine()` returns:
    that is called in a thread once the server is up, and /health answers 503 until it is ready."""
    if (engine is None) == (load_engine is None):
        raise ValueError("give exactly one of engine or load_engine")
    state = ServerState(
        engine=None, served_model_name=served_model_name, api_key=api_key, shutdown_timeout_s=shutdown_timeout_s,
        metrics=ServerMetrics(lambda: state.engine.stats() if state.engine is not None else None),
        load_engine=load_engine, on_load_error=on_load_error,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            await engine.start()
            state.engine = engine
        else:
            state.load_task = asyncio.create_task(_load_in_background(state))
        try:
            yield
        finally:
            await drain(app)

    app = FastAPI(
        title="sudu", version="0.1.0", lifespan=lifespan,
        description="OpenAI-compatible API of sudu, a speed-first LLM inference engine. See docs/server.md.",
    )
    app.state.sudu = state
    _install_error_handlers(app)
    app.include_router(_open_routes(state))
    app.include_router(_api_routes(state), dependencies=[Depends(_auth_dependency(state))])
    return app


async def _load_in_background(state: ServerState) -> None:
    try:
        engine = await _call_in_daemon_thread(state.load_engine)
        await engine.start()
    except Exception as exc:  # noqa: BLE001 -- reported on /health and to the CLI
        if not isinstance(exc, SuduError):
            logger.exception("loading the model failed")
        elif state.on_load_error is None:  # else the caller reports it
            logger.error("loading the model failed: %s", exc)
        state.load_error = f"{type(exc).__name__}: {exc}"
        if state.on_load_error is not None:
            state.on_load_error(exc)
        return
    state.engine = engine
    logger.info("model %s loaded; serving as %s", engine.model_name, state.model_id)


LOAD_THREAD = "sudu-load-model"  # the thread loading the model (server/cli.py checks it at exit)


async def _call_in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Like asyncio.to_thread, but a daemon thread: a shutdown during a long download need not wait for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def work() -> None:
        try:
            result, setter = fn(), future.set_result
        except BaseException as exc:  # noqa: BLE001 -- handed to the awaiting coroutine
            result, setter = exc, future.set_exception
        try:
            loop.call_soon_threadsafe(settle, setter, result)
        except RuntimeError:  # the event loop is already closed: the server stopped meanwhile
            pass

    threading.Thread(target=work, name=LOAD_THREAD, daemon=True).start()
    return await future


async def drain(app: FastAPI) -> None:
    """Stop taking requests and let the engine finish or fail the in-flight ones (each stream then ends
    with its last chunk or an error event). Idempotent; the uvicorn server calls it before waiting for
    connections to close, the lifespan again on exit."""
    state: ServerState = app.state.sudu
    if state.drained is not None:
        await state.drained.wait()
        return
    state.drained = asyncio.Event()
    state.draining = True
    try:
        if state.load_task is not None and not state.load_task.done():
            state.load_task.cancel()
        if state.engine is not None:
            logger.info("draining: waiting up to %.1f s for in-flight requests", state.shutdown_timeout_s)
            await state.engine.shutdown(state.shutdown_timeout_s)
    finally:
        state.drained.set()


# ---------------------------------------------------------------- errors and auth


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        # OpenAI answers 400 for every malformed body, where FastAPI would say 422
        errors = exc.errors()
        first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            message = f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return _error_response(APIError(400, message, code="invalid_json"))
        param = _error_param(first.get("loc", ()))
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        if len({_error_param(e.get("loc", ())) for e in errors}) == 1 and len(errors) > 1:
            message += " (nor does the value match any other accepted form)"  # a union's alternatives
        elif len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        return _error_response(APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message, type_ = f"Unknown route {request.method} {request.url.path}", "not_found_error"
        elif exc.status_code == 405:
            message, type_ = f"Method {request.method} not allowed on {request.url.path}", "invalid_request_error"
        else:
            message, type_ = str(exc.detail), "invalid_request_error"
        return _error_response(APIError(exc.status_code, message, type=type_, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"Internal server error ({type(exc).__name__})", type="server_error"))


def _error_param(loc) -> str | None:
    """`body.messages.0.content` style path of a validation error, without pydantic's union-member tags."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or str(p).isidentifier()] if loc else []
    return ".".join(parts) or None


def _auth_dependency(state: ServerState):
    async def check(request: Request) -> None:
        if not state.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "Missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    return check


def _ready_engine(state: ServerState):
    if state.draining:
        raise APIError(503, "The server is shutting down", type="service_unavailable", code="shutting_down")
    if state.engine is None:
        message = f"Model failed to load: {state.load_error}" if state.load_error else "The model is still loading"
        raise APIError(503, message, type="service_unavailable", code="model_not_ready",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    return state.engine


def _check_model(state: ServerState, requested: str | None) -> str:
    served = state.model_id
    if requested is not None and requested not in (served, state.engine.model_name):
        raise APIError(404, f"The model '{requested}' does not exist; this server serves '{served}'",
                       type="not_found_error", param="model", code="model_not_found")
    return served


def _check_capacity(engine) -> None:
    if engine.is_full():
        raise APIError(429, "The request queue is full; retry shortly", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


# ---------------------------------------------------------------- open routes: /health, /metrics


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health", summary="200 once the model is loaded, 503 before (and while shutting down)")
    async def health():
        if state.engine is None or state.draining:
            status = "shutting_down" if state.draining else ("failed" if state.load_error else "loading")
            body = {"status": status}
            if state.load_error:
                body["error"] = state.load_error
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @router.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


# ---------------------------------------------------------------- OpenAI routes

_ERROR_RESPONSES = {
    status: {"model": P.ErrorResponse} for status in (400, 401, 404, 429, 500, 503)
}


def _api_routes(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models", response_model=P.ModelList, responses=_ERROR_RESPONSES)
    async def list_models():
        engine = _ready_engine(state)
        card = {"id": state.model_id, "object": "model", "created": state.started_at, "owned_by": "sudu",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @router.post("/chat/completions", responses={200: {"model": P.ChatCompletionResponse}, **_ERROR_RESPONSES})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        received_at = time.perf_counter()
        engine = _ready_engine(state)
        model = _check_model(state, body.model)
        _check_capacity(engine)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
        prompt_ids = _render_chat(engine.tokenizer, body.messages)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        jobs = _make_jobs(engine, "chatcmpl", [prompt_ids], body, max_tokens, logprobs, "messages")
        call = _Call(state, jobs, body.n, model, "chat.completion", logprobs, received_at)
        if body.stream:
            return _sse(call.chat_stream(body.stream_options or P.StreamOptions()))
        return await _unless_disconnected(request, call.chat_response())

    @router.post("/completions", responses={200: {"model": P.CompletionResponse}, **_ERROR_RESPONSES})
    async def completions(body: P.CompletionRequest, request: Request):
        received_at = time.perf_counter()
        engine = _ready_engine(state)
        model = _check_model(state, body.model)
        _check_capacity(engine)
        prompts = _tokenize_prompts(engine, body.prompt)
        if len(prompts) * body.n > MAX_CHOICES_PER_REQUEST:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} exceeds {MAX_CHOICES_PER_REQUEST} choices",
                           param="prompt", code="invalid_value")
        jobs = _make_jobs(engine, "cmpl", prompts, body, body.max_tokens, body.logprobs, "prompt")
        echo = [engine.tokenizer.decode(ids) for ids in prompts] if body.echo else None
        call = _Call(state, jobs, body.n, model, "text_completion", body.logprobs, received_at, echo=echo)
        if body.stream:
            return _sse(call.completion_stream(body.stream_options or P.StreamOptions()))
        return await _unless_disconnected(request, call.completion_response())

    return router


# ---------------------------------------------------------------- prompts and sampling


def _flatten_content(content: P.MessageContent | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _render_chat(tokenizer, messages: list[P.ChatMessage]) -> list[int]:
    """Render with the model's chat template; the template writes its own special tokens, so encode
    adds them only when the tokenizer has a BOS the rendered text lacks."""
    rendered = []
    for m in messages:
        msg = {"role": "system" if m.role == "developer" else m.role, "content": _flatten_content(m.content)}
        if m.name is not None:
            msg["name"] = m.name
        rendered.append(msg)
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 -- templates reject message orders with raise_exception()
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages",
                       code="invalid_value") from exc
    bos = getattr(tokenizer, "bos_token", None)
    ids = tokenizer.encode(text, add_special_tokens=bool(bos) and not text.startswith(bos))
    if not ids:
        raise APIError(400, "The rendered prompt is empty", param="messages", code="invalid_value")
    return ids


def _tokenize_prompts(engine, prompt: P.PromptInput) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    prompts: list[list[int]] = []
    for p in prompt:
        ids = engine.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "The prompt encodes to no tokens", param="prompt", code="invalid_value")
        prompts.append(ids)
    return prompts


@dataclass
class _Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int


def _make_jobs(engine, id_prefix: str, prompts: list[list[int]], body: P._SamplingFields, max_tokens: int | None,
               logprobs: int | None, prompt_param: str) -> list[_Job]:
    """One engine request per prompt, each checked (length against the context, token ids against the
    vocabulary) before anything is queued. max_tokens None: the engine gives each prompt the rest of
    its context."""
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    params = _sampling_params(body, max_tokens, logprobs)
    jobs = []
    for i, ids in enumerate(prompts):
        try:
            engine.check_request(ids, params)
        except RequestTooLongError as exc:
            raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from exc
        except (SuduError, ValueError) as exc:
            raise APIError(400, str(exc), param=prompt_param, code="invalid_value") from exc
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        jobs.append(_Job(rid, ids, params, body.priority))
    return jobs


def _sampling_params(body: P._SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    try:
        return SamplingParams(
            n=body.n,
            temperature=0.0 if body.temperature < GREEDY_TEMPERATURE else body.temperature,
            top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, seed=body.seed, max_tokens=max_tokens, stop=list(stop),
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=logprobs,
        )
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split(" ", 1)[0], code="invalid_value") from exc


# ---------------------------------------------------------------- generation


async def _shielded_abort(engine, request_id: str) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await engine.abort(request_id)
        except Exception:  # noqa: BLE001 -- the request may already be gone
            logger.debug("abort of %s failed", request_id, exc_info=True)


async def _generate_one(engine, job_index: int, job: _Job) -> AsyncIterator[tuple[int, Any]]:
    finished = False
    outputs = engine.generate(job.request_id, job.prompt_ids, job.params, priority=job.priority)
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


_JOB_DONE = object()


async def _generate_all(engine, jobs: list[_Job]) -> AsyncIterator[tuple[int, Any]]:
    """(job index, RequestOutput) of every job, interleaved as they come; leaving early aborts them all."""
    if len(jobs) == 1:
        async with aclosing(_generate_one(engine, 0, jobs[0])) as outputs:
            async for item in outputs:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: _Job) -> None:
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


class _EngineRequestError(Exception):
    pass


def _timing(out, now: float) -> dict:
    m = out.metrics
    if m.finished_time is not None or m.first_token_time is None:
        decode_s = m.decode_s
    else:
        decode_s = now - m.first_token_time
    ttft_s = (m.first_token_time - m.arrival_time) if m.first_token_time is not None else 0.0
    timing = {"queue_s": round(m.queue_s, 6), "prefill_s": round(m.prefill_s, 6), "decode_s": round(decode_s, 6),
              "ttft_s": round(ttft_s, 6), "cached_tokens": out.num_cached_tokens}
    if m.num_spec_steps:  # speculative decoding ran for this request
        timing.update(num_draft_tokens=m.num_draft_tokens, num_accepted_tokens=m.num_accepted_tokens,
                      acceptance_rate=round(m.acceptance_rate, 4), mean_accepted_len=round(m.mean_accepted_len, 4))
    return timing


def _merge_timings(timings: list[dict]) -> dict:
    """Several prompts in one call: the slowest of each phase, the sum of cached tokens."""
    if len(timings) == 1:
        return timings[0]
    merged = {k: max(t[k] for t in timings) for k in ("queue_s", "prefill_s", "decode_s", "ttft_s")}
    merged["cached_tokens"] = sum(t["cached_tokens"] for t in timings)
    drafted = sum(t.get("num_draft_tokens", 0) for t in timings)
    if drafted:
        accepted = sum(t.get("num_accepted_tokens", 0) for t in timings)
        merged.update(num_draft_tokens=drafted, num_accepted_tokens=accepted,
                      acceptance_rate=round(accepted / drafted, 4))
    return merged


def _server_timing(timing: dict) -> str:
    return ", ".join(f"{k};dur={timing[k + '_s'] * 1000:.3f}" for k in ("queue", "prefill", "decode"))


def _chat_logprobs(entries) -> list[dict]:
    return [
        {
            "token": e.token, "logprob": max(e.logprob, _LOGPROB_FLOOR), "bytes": list(e.token.encode()),
            "top_logprobs": [
                {"token": text, "logprob": max(lp, _LOGPROB_FLOOR), "bytes": list(text.encode())}
                for _, text, lp in e.top
            ],
        }
        for e in entries
    ]


class _CompletionLogprobs:
    """OpenAI's legacy completions logprobs shape, with text offsets running across stream chunks."""

    def __init__(self, start_offset: int = 0):
        self.offset = start_offset

    def render(self, entries) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.token)
            token_logprobs.append(max(e.logprob, _LOGPROB_FLOOR))
            top.append({text: max(lp, _LOGPROB_FLOOR) for _, text, lp in e.top})
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class _Call:
    """One API call in flight: its engine jobs, per-choice accounting, metrics, and the two renderings
    (stream / single body) of chat and text completions."""

    def __init__(self, state: ServerState, jobs: list[_Job], n: int, model: str, object_: str,
                 logprobs: int | None, received_at: float, echo: list[str] | None = None):
        self.state, self.engine, self.metrics = state, state.engine, state.metrics
        self.jobs, self.n, self.model, self.logprobs, self.echo = jobs, n, model, logprobs, echo
        self.id = jobs[0].request_id.rsplit("-", 1)[0] if len(jobs) > 1 else jobs[0].request_id
        self.object = object_
        self.created = int(time.time())
        self.received_at = received_at  # handler entry: TTFT and e2e metrics include templating + tokenizing
        num_choices = len(jobs) * n
        self.num_tokens = [0] * num_choices
        self.finish_reasons: list[str | None] = [None] * num_choices
        self.timings: list[dict | None] = [None] * len(jobs)
        self.num_cached = [0] * len(jobs)
        self._first_token_at: list[float | None] = [None] * len(jobs)
        self._last_token_at: list[float | None] = [None] * len(jobs)
        for job in jobs:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))

    # -- accounting shared by every rendering

    def observe(self, job_index: int, out) -> float:
        """Count tokens, feed latency metrics; returns now."""
        now = time.perf_counter()
        new_tokens = 0
        for c in out.outputs:
            idx = job_index * self.n + c.index
            self.num_tokens[idx] = max(self.num_tokens[idx] + len(c.token_ids), c.num_output_tokens)
            new_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons[idx] = c.finish_reason
                self.metrics.request_success.labels(finish_reason=c.finish_reason).inc()
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if self._first_token_at[job_index] is None:
                self._first_token_at[job_index] = now
                self.metrics.time_to_first_token.observe(now - self.received_at)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_at[job_index])
            self._last_token_at[job_index] = now
        self.num_cached[job_index] = out.num_cached_tokens
        if out.finished:
            self.timings[job_index] = _timing(out, now)
            self.metrics.e2e_request_latency.observe(now - self.received_at)
            self.metrics.request_queue_time.observe(out.metrics.queue_s)
        return now

    def usage(self) -> dict:
        prompt = sum(len(j.prompt_ids) for j in self.jobs)
        completion = sum(self.num_tokens)
        cached = sum(self.num_cached)
        return {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt - cached,
        }

    def timing(self) -> dict:
        return _merge_timings([t or {"queue_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "ttft_s": 0.0,
                                     "cached_tokens": c} for t, c in zip(self.timings, self.num_cached)])

    def _chunk(self, choices: list[dict], **extra) -> bytes:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices}
        body.update(extra)
        return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    # -- single JSON bodies

    async def _collect(self) -> tuple[list[list[str]], list[list]]:
        texts: list[list[str]] = [[] for _ in self.num_tokens]
        logprob_entries: list[list] = [[] for _ in self.num_tokens]
        async with aclosing(_generate_all(self.engine, self.jobs)) as outputs:
            async for job_index, out in outputs:
                self.observe(job_index, out)
                for c in out.outputs:
                    idx = job_index * self.n + c.index
                    texts[idx].append(c.text)
                    if c.logprobs:
                        logprob_entries[idx].extend(c.logprobs)
                if out.error is not None:
                    raise _EngineRequestError(out.error)
        return texts, logprob_entries

    def _json(self, body: dict) -> JSONResponse:
        timing = body["sudu"]
        return JSONResponse(body, headers={"Server-Timing": _server_timing(timing)})

    async def chat_response(self) -> JSONResponse:
        texts, entries = await self._collect()
        choices = [
            {
                "index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                "logprobs": {"content": _chat_logprobs(entries[i])} if self.logprobs is not None else None,
                "finish_reason": self.finish_reasons[i],
            }
            for i in range(len(texts))
        ]
        return self._json({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                           "choices": choices, "usage": self.usage(), "sudu": self.timing()})

    async def completion_response(self) -> JSONResponse:
        texts, entries = await self._collect()
        choices = []
        for i in range(len(texts)):
            prefix = self.echo[i // self.n] if self.echo else ""
            logprobs = _CompletionLogprobs(len(prefix)).render(entries[i]) if self.logprobs is not None else None
            choices.append({"index": i, "text": prefix + "".join(texts[i]), "logprobs": logprobs,
                            "finish_reason": self.finish_reasons[i]})
        return self._json({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                           "choices": choices, "usage": self.usage(), "sudu": self.timing()})

    # -- streams

    def _error_event(self, exc: BaseException) -> bytes:
        if self.state.draining:
            err = APIError(503, f"The server shut down before the request finished: {exc}",
                           type="service_unavailable", code="request_aborted")
        elif isinstance(exc, _EngineRequestError):
            err = APIError(500, f"The engine failed the request: {exc}", type="server_error", code="request_aborted")
        else:
            logger.error("stream %s failed", self.id, exc_info=exc)
            err = APIError(500, f"Internal server error ({type(exc).__name__})", type="server_error")
        return b"data: " + json.dumps(err.body()).encode() + b"\n\n"

    async def chat_stream(self, options: P.StreamOptions) -> AsyncIterator[bytes]:
        self.object = "chat.completion.chunk"
        for i in range(len(self.num_tokens)):
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])

        def choice(idx, text, logprobs, finish_reason):
            rendered = None
            if logprobs is not None:
                rendered = {"content": _chat_logprobs(logprobs)}
            return {"index": idx, "delta": {"content": text} if text is not None else {}, "logprobs": rendered,
                    "finish_reason": finish_reason}

        async for chunk in self._stream(options, choice):
            yield chunk

    async def completion_stream(self, options: P.StreamOptions) -> AsyncIterator[bytes]:
        offsets = [_CompletionLogprobs() for _ in self.num_tokens]
        if self.echo:
            for i in range(len(self.num_tokens)):
                prefix = self.echo[i // self.n]
                offsets[i].offset = len(prefix)
                yield self._chunk([{"index": i, "text": prefix, "logprobs": None, "finish_reason": None}])

        def choice(idx, text, logprobs, finish_reason):
            rendered = offsets[idx].render(logprobs) if logprobs is not None else None
            return {"index": idx, "text": text or "", "logprobs": rendered, "finish_reason": finish_reason}

        async for chunk in self._stream(options, choice):
            yield chunk

    async def _stream(self, options: P.StreamOptions, choice) -> AsyncIterator[bytes]:
        """Content chunks, a finish chunk per choice (with sudu's timing), the optional usage chunk and
        [DONE]. choice(index, text | None, logprobs | None, finish_reason) renders one API's choice."""
        want_logprobs = self.logprobs is not None
        running_usage = options.continuous_usage_stats
        try:
            async with aclosing(_generate_all(self.engine, self.jobs)) as outputs:
                async for job_index, out in outputs:
                    now = self.observe(job_index, out)
                    for c in out.outputs:
                        idx = job_index * self.n + c.index
                        if c.text or (want_logprobs and c.logprobs):
                            chunk = [choice(idx, c.text, (c.logprobs or []) if want_logprobs else None, None)]
                            yield self._chunk(chunk, usage=self.usage()) if running_usage else self._chunk(chunk)
                        if c.finish_reason is not None and out.error is None:
                            yield self._chunk([choice(idx, None, None, c.finish_reason)], sudu=_timing(out, now))
                    if out.error is not None:
                        raise _EngineRequestError(out.error)
            if options.include_usage:
                yield self._chunk([], usage=self.usage(), sudu=self.timing())
        except Exception as exc:  # noqa: BLE001 -- a stream ends with an error event, never cut short
            yield self._error_event(exc)
        yield b"data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """Closes its body iterator on every exit, so a client that disconnects between two chunks still
    aborts its engine request at once rather than whenever the generator is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def _sse(body: AsyncIterator[bytes]) -> StreamingResponse:
    return _SSEResponse(body, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work) -> Response:
    """Run a non-streaming call, aborting it (and so freeing its KV blocks) if the client goes away."""
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
    if exc is not None and request.app.state.sudu.draining:
        raise APIError(503, f"The server shut down before the request finished: {exc}",
                       type="service_unavailable", code="request_aborted")
    if isinstance(exc, _EngineRequestError):
        raise APIError(500, f"The engine failed the request: {exc}", type="server_error", code="request_aborted")
    if exc is not None:
        raise exc
    return task.result()


# ---------------------------------------------------------------- running under uvicorn


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info"):
    """A uvicorn server that, on SIGINT/SIGTERM, stops listening, then drains (in-flight requests
    finish within the app's shutdown timeout or end with an error event), then exits normally."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            for s in self.servers:
                s.close()
            await drain(app)
            await super().shutdown(sockets)

        @contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                # the drain is the answer to SIGINT/SIGTERM: exit normally instead of re-raising it
                getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                            timeout_graceful_shutdown=max(1.0, app.state.sudu.shutdown_timeout_s) + 5.0)
    return DrainingServer(config)
