"""The OpenAI-compatible HTTP server's lifecycle: `build_app(engine)` assembles the FastAPI app (error
handlers, body-size limit, routes) around one engine, started in the app's lifespan or loaded in a
background thread; `drain` stops taking requests and lets the in-flight ones finish or fail;
`make_server` runs the app under uvicorn with that drain on SIGINT/SIGTERM. If the engine fails,
/health turns 503 and `on_engine_failure` is told (`sudu serve` then exits non-zero).

Request path: pydantic validates the body -> the route admits the call (routes.py) -> the chat
template, tokenization and the engine's one check run in a worker pool (requests.py, limits.py) ->
`engine.generate` (the engine loop runs in its own thread) yields per-step deltas (generation.py) ->
they leave as SSE chunks or are gathered into one JSON body (responses.py, streaming.py). Every early
exit (client gone, error, shutdown) aborts the engine request so its KV blocks return to the pool."""
from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Callable

from fastapi import Depends, FastAPI

from sudu.errors import SuduError
from sudu.server.api_messages import messages_routes
from sudu.server.api_responses import responses_routes
from sudu.server.auth import api_key_dependency
from sudu.server.engine_protocol import ServingEngine
from sudu.server.errors import install_error_handlers
from sudu.server.limits import BodySizeLimit, PreparePool, ServerLimits
from sudu.server.media_input import MediaPolicy
from sudu.server.metrics import ServerMetrics
from sudu.server.routes import _admit, api_routes, open_routes
from sudu.server.state import ServerState

logger = logging.getLogger("sudu.server")

LOAD_THREAD = "sudu-load-model"  # the thread loading the model (commands/serve.py checks it at exit)


def build_app(
    engine: ServingEngine | None = None,
    *,
    load_engine: Callable[[], ServingEngine] | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_timeout_s: float = 30.0,
    limits: ServerLimits = ServerLimits(),
    media: MediaPolicy = MediaPolicy(),
    on_load_error: Callable[[BaseException], None] | None = None,
    on_engine_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """An app serving `engine` (started in the app's lifespan), or the engine `load_engine()` returns:
    that is called in a thread once the server is up, and /health answers 503 until it is ready."""
    if (engine is None) == (load_engine is None):
        raise ValueError("give exactly one of engine or load_engine")
    limits.validate()
    state = ServerState(
        engine=None, served_model_name=served_model_name, api_key=api_key, shutdown_timeout_s=shutdown_timeout_s,
        metrics=ServerMetrics(lambda: state.engine.stats() if state.engine is not None else None),
        pool=PreparePool(limits.prepare_workers, limits.prepare_queue), media=media,
        load_engine=load_engine, on_load_error=on_load_error, on_engine_failure=on_engine_failure,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            await engine.start()
            _serve(state, engine)
        else:
            state.tasks.append(asyncio.create_task(_load_in_background(state)))
        try:
            yield
        finally:
            await drain(app)
            state.pool.shutdown()

    app = FastAPI(
        title="sudu", version="0.1.0", lifespan=lifespan,
        description="OpenAI-compatible API of sudu, a speed-first LLM inference engine. See docs/server.md.",
    )
    app.state.sudu = state
    install_error_handlers(app, state.metrics.count_error)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes, count=state.metrics.count_error)
    app.include_router(open_routes(state))
    app.include_router(api_routes(state), dependencies=[Depends(api_key_dependency(api_key))])
    app.include_router(messages_routes(state, _admit), dependencies=[Depends(api_key_dependency(api_key))])
    app.include_router(responses_routes(state, _admit), dependencies=[Depends(api_key_dependency(api_key))])
    return app


def _serve(state: ServerState, engine: ServingEngine) -> None:
    """The engine is started: route requests to it, and watch for its failure."""
    state.engine = engine
    state.tasks.append(asyncio.create_task(_watch_engine(state, engine)))


async def _watch_engine(state: ServerState, engine: ServingEngine) -> None:
    reason = await engine.wait_failed()
    state.engine_failure = reason
    logger.critical("the engine failed: %s; /health is 503 and the server stops", reason)
    if state.on_engine_failure is not None:
        state.on_engine_failure(reason)


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
    _serve(state, engine)
    logger.info("model %s loaded; serving as %s", engine.model_name, state.model_id)


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
        for task in state.tasks:
            task.cancel()
        if state.engine is not None:
            logger.info("draining: waiting up to %.1f s for in-flight requests", state.shutdown_timeout_s)
            await state.engine.shutdown(state.shutdown_timeout_s)
    finally:
        state.drained.set()


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info"):
    """A uvicorn server that, on SIGINT/SIGTERM, drains: it keeps listening but admits nothing new (503
    with Retry-After, /health 503, so a load balancer or Kubernetes moves traffic away), lets in-flight
    requests finish within the app's drain timeout (the rest end with an error event), then stops
    listening and exits normally."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await drain(app)
            for s in self.servers:
                s.close()
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
