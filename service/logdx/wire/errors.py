"""The error every face answers with: an HTTP-style status, a stable machine-readable code and a
human message, in one JSON shape ``{"error": {"code": ..., "message": ...}}``.

Neutral: the job runtime (`logdx.jobs`) raises it, the HTTP face (`logdx.api.errors`) renders it, the
MCP face (`logdx.agent`) maps it to a tool error. Nothing here imports a web framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """The body of every 4xx/5xx answer (extra keys such as `accepted_lines` may appear)."""

    error: ErrorDetail


class ApiError(Exception):
    """An error with an HTTP status, a stable machine-readable code and a human message."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})
        self.details = details


def error_body(code: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **details}}
