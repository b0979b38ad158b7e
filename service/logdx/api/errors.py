"""Every error a client sees is one JSON shape: ``{"error": {"code": ..., "message": ...}}``.

`ApiError` (`logdx.wire.errors`) is raised anywhere (routes, the job runtime's threads) and rendered here by one handler; Starlette's
404/405 and FastAPI's validation errors are rendered in the same shape; anything unexpected is
logged server-side with a request id and answered with a bare 500, never a stack trace.

An outage of what the service stands on is not a bug: the shared database (`StoreError`, from
PostgreSQL) or the line bus (`BusError`, NATS) unreachable is a 503 `store_unavailable` /
`bus_unavailable` (`bus_full` when the bus refuses records) with `Retry-After`, never a 500.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from logdx.bus.base import BusError, BusFull
from logdx.store_base import StoreError
from logdx.wire.errors import ApiError, error_body

log = logging.getLogger("logdx.api")


def error_response(status: int, code: str, message: str, headers: Mapping[str, str] | None = None,
                   **details: Any) -> JSONResponse:
    return JSONResponse(error_body(code, message, **details), status_code=status, headers=dict(headers or {}))


_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
    503: "unavailable",
}


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.headers, **exc.details)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _STATUS_CODES.get(exc.status_code, "http_error")
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, code, message, getattr(exc, "headers", None))


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "malformed_json", "the request body is not valid JSON")
    problems = [
        {"where": ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body", "problem": e.get("msg", "")}
        for e in errors[:20]
    ]
    first = problems[0] if problems else {"where": "body", "problem": "invalid"}
    return error_response(422, "invalid_request", f"{first['where']}: {first['problem']}", problems=problems)


# Seconds a client should wait after an outage answer: the store's pool reconnects within about a
# second of the server's return, NATS's client within half a second.
OUTAGE_RETRY_AFTER_S = 2
_last_outage_log: dict[str, float] = {}


def _log_outage(kind: str, request: Request, exc: Exception) -> None:
    """One line per kind of outage every 10 s (each request of an outage would log it again)."""
    now = time.monotonic()
    if now - _last_outage_log.get(kind, -10.0) >= 10.0:
        _last_outage_log[kind] = now
        log.warning("%s %s answered 503 %s: %s", request.method, request.url.path, kind, exc)


async def _store_error(request: Request, exc: Exception) -> JSONResponse:
    _log_outage("store_unavailable", request, exc)
    return error_response(503, "store_unavailable", "the database is unreachable or did not answer in time "
                          "(store.timeout_s); retry: an upload answered so applied none of its lines, and /end "
                          "may be sent again",
                          {"Retry-After": str(OUTAGE_RETRY_AFTER_S)})


async def _bus_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, BusFull):
        _log_outage("bus_full", request, exc)
        return error_response(503, "bus_full", f"the line bus is full ({exc}); retry later",
                              {"Retry-After": str(5 * OUTAGE_RETRY_AFTER_S)})
    _log_outage("bus_unavailable", request, exc)
    return error_response(503, "bus_unavailable", f"the line bus is unreachable ({exc}); retry",
                          {"Retry-After": str(OUTAGE_RETRY_AFTER_S)})


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(BusError, _bus_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


class CatchAllMiddleware:
    """The last line: an unexpected exception is logged with a request id and answered with a
    generic 500 JSON body (the id lets an operator find the traceback; the client sees nothing
    of the internals). A pure ASGI middleware, so streaming bodies pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            request_id = uuid.uuid4().hex[:12]
            log.exception("unhandled error in %s %s (request %s)", scope.get("method"), scope.get("path"), request_id)
            if started:
                return  # too late for a clean answer: the server closes the connection
            response = error_response(500, "internal_error", f"internal error (request id {request_id})",
                                      {"x-request-id": request_id})
            await response(scope, receive, send)
