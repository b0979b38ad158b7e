"""The HTTP face of the service: routes, authentication, and the mapping to wire models (`logdx.wire`) over
the job runtime (`logdx.jobs`: ingestion per job, early and final diagnosis, alerts, actions), which knows
nothing of HTTP.

`create_app(settings)` builds the FastAPI app; `add_serve_parser(sub)` registers `logdx serve`.
Importing this package stays cheap (FastAPI is loaded by `create_app`, not here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from logdx.api.server import add_serve_parser

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["add_serve_parser", "create_app"]


def create_app(*args: Any, **kwargs: Any) -> FastAPI:
    from logdx.api.app import create_app as _create_app

    return _create_app(*args, **kwargs)
