"""The FastAPI application: `create_app(settings)` builds it; `logdx serve` runs it with uvicorn."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from logdx import __version__, progress
from logdx.api.cluster import cluster_router
from logdx.api.deps import require_token
from logdx.api.errors import CatchAllMiddleware, install_error_handlers
from logdx.api.guard import KNOWN_METHODS, RequestGuard
from logdx.api.nodes import nodes_router
from logdx.api.pages import STATIC_PREFIX, pages_router, static_files
from logdx.api.routes import api, health, metrics_router
from logdx.api.services import Services
from logdx.api.uploads import uploads
from logdx.config import Settings, load_settings
from logdx.jobs.metrics import Metrics
from logdx.pipeline import Engine

log = logging.getLogger("logdx.api")

# How `logdx serve` hands its settings to worker processes: outside the LOGDX_* names, which are
# all settings a user may set (and checked as such).
SETTINGS_ENV = "_LOGDX_SERVE_SETTINGS_JSON"


class MetricsMiddleware:
    """Counts and times every HTTP request by method, route template and status: labels from fixed
    sets (the known methods, the routes' templates or "unmatched"), whatever a client sends."""

    def __init__(self, app: ASGIApp, get_metrics) -> None:
        self.app = app
        self.get_metrics = get_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            metrics: Metrics | None = self.get_metrics()
            if metrics is not None:
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                method = scope.get("method", "")
                method = method if method in KNOWN_METHODS else "other"
                metrics.http.labels(method, path, str(status)).inc()
                metrics.http_latency.labels(method, path).observe(time.perf_counter() - t0)


def create_app(settings: Settings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """The app. `settings` default to `load_settings()` (file + LOGDX_* env); pass `engine` to
    share an already loaded one (tests, embedding)."""
    settings = settings or load_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Slow first-time steps (converting the LLM, indexing incidents) go to the log, with how far.
        listener = progress.to_log(log)
        services = Services.open(settings)
        app.state.services = services
        services.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(services.load_engine, engine)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
            services.stop()
        finally:
            progress.remove_listener(listener)
            app.state.services = None

    app = FastAPI(
        title="logdx",
        version=__version__,
        summary="Why did this training job fail? Stream its logs in, get a diagnosis out.",
        lifespan=lifespan,
        openapi_url=None,  # served by docs_router, behind the token
        docs_url=None,
        redoc_url=None,
    )
    app.state.services = None
    install_error_handlers(app)
    app.include_router(health)
    app.include_router(metrics_router)
    app.include_router(api)
    app.include_router(uploads)
    app.include_router(nodes_router)
    app.include_router(cluster_router)
    app.include_router(docs_router)
    app.include_router(pages_router)
    app.mount(STATIC_PREFIX, static_files(), name="static")
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(MetricsMiddleware, get_metrics=lambda: getattr(app.state.services, "metrics", None))

    def refused(reason: str) -> None:
        metrics: Metrics | None = getattr(app.state.services, "metrics", None)
        if metrics is not None:
            metrics.refused.labels(reason).inc()

    app.add_middleware(RequestGuard, server=settings.server, on_refused=refused)  # outermost: first to judge
    return app


# The schema and the docs describe every route: they need the token as the routes do.
docs_router = APIRouter(dependencies=[Depends(require_token)], include_in_schema=False)


@docs_router.get("/openapi.json")
async def openapi_schema(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


# The docs pages load their scripts from the package (swagger-ui-dist and redoc, from npm): air-gapped
# clusters reach no CDN.
_VENDOR = f"{STATIC_PREFIX}/vendor"


@docs_router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title="logdx API", swagger_js_url=f"{_VENDOR}/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{_VENDOR}/swagger-ui/swagger-ui.css",
        swagger_favicon_url=f"{_VENDOR}/swagger-ui/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None})  # its default asks validator.swagger.io


@docs_router.get("/redoc")
async def redoc() -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title="logdx API",
                          redoc_js_url=f"{_VENDOR}/redoc/redoc.standalone.js",
                          redoc_favicon_url=f"{_VENDOR}/swagger-ui/favicon-32x32.png", with_google_fonts=False)


def app_from_env() -> FastAPI:
    """Factory for uvicorn worker processes (`--workers > 1`): settings come from the parent."""
    raw = os.environ.get(SETTINGS_ENV)
    settings = Settings.model_validate_json(raw) if raw else load_settings()
    return create_app(settings)
