"""OpenAI-style errors: `APIError` (a status and OpenAI's `{"error": {message, type, param, code}}` body),
the handlers that give every failure that body (validation, unknown routes, an oversized body, any
unexpected exception), and the named errors the routes raise. Under /v1/messages (Anthropic's Messages
API) the same errors answer in Anthropic's shape, `{"type": "error", "error": {type, message}}`."""
from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sudu.errors import EngineFailedError

logger = logging.getLogger("sudu.server")

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The same error in Anthropic's shape, its type from the status as Anthropic's API reference
        lists them (429 rate_limit_error, 503/529 overloaded_error, ...); a 429 the server gives because it is
        overloaded (a full queue, a predicted wait over the limit), not because of the client's own rate, is
        Anthropic's overloaded_error, with the status kept at 429 and Retry-After set."""
        message = f"{self.param}: {self.message}" if self.param and not self.message.startswith(self.param) \
            else self.message
        kind = "overloaded_error" if self.code in _OVERLOAD_CODES else _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
_OVERLOAD_CODES = ("queue_full", "server_overloaded")
ANTHROPIC_PATH = "/v1/messages"  # routes under it answer errors in Anthropic's shape


class EngineRequestError(Exception):
    """The engine failed this one request (its RequestOutput carried an error)."""


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def queue_full(what: str = "The request queue is full") -> APIError:
    return APIError(429, f"{what}; retry shortly", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def shutting_down() -> APIError:
    # Retry-After: a load balancer's other replicas answer meanwhile; this one is draining (docs/server.md)
    return APIError(503, "The server is shutting down", type="service_unavailable", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_failed(reason: str) -> APIError:
    return APIError(503, f"The engine failed and the server is restarting: {reason}", type="service_unavailable",
                    code="engine_failed")


def failed_call(exc: BaseException, draining: bool) -> APIError:
    """The error a client gets for a call that failed after it was admitted (a stream's error event or a
    non-stream response)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineFailedError):
        return engine_failed(str(exc))
    if draining:
        return APIError(503, f"The server shut down before the request finished: {exc}",
                        type="service_unavailable", code="request_aborted")
    if isinstance(exc, EngineRequestError):
        return APIError(500, f"The engine failed the request: {exc}", type="server_error", code="request_aborted")
    logger.error("a request failed unexpectedly", exc_info=exc)
    return APIError(500, f"Internal server error ({type(exc).__name__})", type="server_error")


def install_error_handlers(app: FastAPI, count: Callable[[APIError], None]) -> None:
    """Every failure answered as OpenAI's error body; count(err) sees each one (the error metric)."""

    def error_response(err: APIError, request: Request | None = None) -> JSONResponse:
        count(err)
        anthropic = request is not None and request.url.path.startswith(ANTHROPIC_PATH)
        return JSONResponse(err.anthropic_body() if anthropic else err.body(), status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # OpenAI answers 400 for every malformed body, where FastAPI would say 422
        errors = exc.errors()
        first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            message = f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return error_response(APIError(400, message, code="invalid_json"), request)
        param = _error_param(first.get("loc", ()))
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        if len({_error_param(e.get("loc", ())) for e in errors}) == 1 and len(errors) > 1:
            message += " (nor does the value match any other accepted form)"  # a union's alternatives
        elif len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        return error_response(invalid(message, param), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = None
        if exc.status_code == 404:
            message, type_ = f"Unknown route {request.method} {request.url.path}", "not_found_error"
        elif exc.status_code == 405:
            message, type_ = f"Method {request.method} not allowed on {request.url.path}", "invalid_request_error"
        else:
            message, type_ = str(exc.detail), "invalid_request_error"
            code = "request_too_large" if exc.status_code == 413 else None
        return error_response(APIError(exc.status_code, message, type=type_, code=code,
                                       headers=getattr(exc, "headers", None)), request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"Internal server error ({type(exc).__name__})", type="server_error"),
                              request)


def _error_param(loc) -> str | None:
    """`body.messages.0.content` style path of a validation error, without pydantic's union-member tags."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or str(p).isidentifier()] if loc else []
    return ".".join(parts) or None
