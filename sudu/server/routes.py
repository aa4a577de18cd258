"""The HTTP routes. Open: /health, /metrics. OpenAI (/v1, behind the API key): models, chat and text
completions. A completion route admits the call (model ready, model name, queue room), has the request
prepared in the worker pool (requests.py), and hands the result to the renderer (responses.py) as a
stream or a single body."""
from __future__ import annotations

import time
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from sudu.server import protocol as P
from sudu.server.admission import admit_by_wait
from sudu.server.errors import (
    RETRY_AFTER_S,
    APIError,
    engine_failed,
    queue_full,
    shutting_down,
)
from sudu.server.limits import PoolFull
from sudu.server.requests import PreparedCall, prepare_chat, prepare_completion
from sudu.server.responses import Call
from sudu.server.state import ServerState
from sudu.server.streaming import sse, unless_disconnected

_ERROR_RESPONSES = {status: {"model": P.ErrorResponse} for status in (400, 401, 403, 404, 413, 429, 500, 503)}

# OpenAPI links: how a client chains the routes (the served model's id into a completion, an answer
# into the next turn). Documentation for clients, and the transitions of the stateful fuzz test.
_MODEL_LINKS = {
    "chat": {"operationId": "create_chat_completion", "requestBody": {"model": "$response.body#/data/0/id"}},
    "complete": {"operationId": "create_completion", "requestBody": {"model": "$response.body#/data/0/id"}},
}
_CHAT_LINKS = {
    "next_turn": {"operationId": "create_chat_completion", "requestBody": {
        "model": "$response.body#/model",
        "messages": [{"role": "assistant", "content": "$response.body#/choices/0/message/content"},
                     {"role": "user", "content": "Go on."}],
    }},
}
_COMPLETION_LINKS = {
    "continue": {"operationId": "create_completion", "requestBody": {
        "model": "$response.body#/model", "prompt": "$response.body#/choices/0/text"}},
}


def ready_engine(state: ServerState):
    if state.draining:
        raise shutting_down()
    if state.engine_failure is not None:
        raise engine_failed(state.engine_failure)
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


async def _admit(state: ServerState, body, prepare, generates: bool = True) -> tuple[PreparedCall, str]:
    """Checks that cost nothing first; then the request is prepared off the event loop, and, for a request that
    generates (not a token count), admitted by its predicted wait."""
    engine = ready_engine(state)
    model = _check_model(state, body.model)
    if engine.is_full():
        raise queue_full()
    try:
        prepared = await state.pool.run(prepare, engine, body)
    except PoolFull:
        raise queue_full("The server's request-preparation queue is full") from None
    if engine.is_full():  # it may have filled while this request was prepared
        raise queue_full()
    if not generates:
        return prepared, model
    try:
        await state.pool.run(admit_by_wait, engine, state.metrics, prepared)
    except PoolFull:
        raise queue_full("The server's request-preparation queue is full") from None
    return prepared, model


def open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health", summary="200 once the model is loaded; 503 before, after an engine failure, "
                                   "and while shutting down")
    async def health():
        if state.engine is None or state.draining or state.engine_failure is not None:
            if state.draining:
                body = {"status": "shutting_down"}
            elif state.engine_failure is not None:
                body = {"status": "failed", "error": state.engine_failure}
            elif state.load_error:
                body = {"status": "failed", "error": state.load_error}
            else:
                body = {"status": "loading"}
            return JSONResponse(body, status_code=503)
        if state.health is not None:
            status_code, body = await state.health()
            return JSONResponse(body, status_code=status_code)
        return {"status": "ok"}

    @router.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


def api_routes(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")
    draining = lambda: state.draining  # noqa: E731

    @router.get("/models", response_model=P.ModelList, operation_id="list_models",
                responses={200: {"links": _MODEL_LINKS}, **_ERROR_RESPONSES})
    async def list_models():
        engine = ready_engine(state)
        card = {"id": state.model_id, "object": "model", "created": state.started_at, "owned_by": "sudu",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    async def complete(body, request: Request, prepare, object_: str, stream, single) -> Response:
        received_at = time.perf_counter()
        prepared, model = await _admit(state, body, prepare)
        call = Call(state.engine, state.metrics, prepared, model, object_, received_at, draining)
        if body.stream:
            return sse(stream(call, body.stream_options or P.StreamOptions()))
        return await unless_disconnected(request, single(call), draining)

    @router.post("/chat/completions", operation_id="create_chat_completion",
                 responses={200: {"model": P.ChatCompletionResponse, "links": _CHAT_LINKS}, **_ERROR_RESPONSES})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await complete(body, request, partial(prepare_chat, media=state.media), "chat.completion",
                              Call.chat_stream, Call.chat_response)

    @router.post("/completions", operation_id="create_completion",
                 responses={200: {"model": P.CompletionResponse, "links": _COMPLETION_LINKS}, **_ERROR_RESPONSES})
    async def completions(body: P.CompletionRequest, request: Request):
        return await complete(body, request, prepare_completion, "text_completion", Call.completion_stream,
                              Call.completion_response)

    return router
