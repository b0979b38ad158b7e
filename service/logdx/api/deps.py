"""Dependencies: what routes get injected (services, settings, the engine), and the guards
(bearer token, job id, readiness)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Path, Request

from logdx.access.auth import Principal
from logdx.api.cookies import COOKIE, identify
from logdx.api.services import Services
from logdx.config import Settings
from logdx.jobs.limits import check_job_id
from logdx.jobs.readiness import Check, Readiness
from logdx.pipeline import Engine
from logdx.tenancy import JOB_ID_PATTERN
from logdx.wire.errors import ApiError


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_settings(services: ServicesDep) -> Settings:
    return services.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_engine(services: ServicesDep) -> Engine:
    """The engine (rules and models), or 503 `not_ready` while it loads (see `ready_engine`)."""
    if services.engine is not None:
        return services.engine
    return ready_engine(services, services.readiness.checks())


def ready_engine(services: Services, checks: dict[str, Check]) -> Engine:
    """The engine when it is loaded and every readiness check passes, else 503 `not_ready` saying
    what the service waits for (`waiting_for`: a reason per part) with every check's state."""
    waiting = Readiness.waiting_for(checks)
    if services.engine is not None and not waiting:
        return services.engine
    details: dict[str, Any] = {"waiting_for": waiting, "checks": {name: c.to_json() for name, c in checks.items()}}
    if services.startup_error:
        raise ApiError(503, "not_ready", f"the engine failed to start: {services.startup_error}", **details)
    if not waiting:  # the parts are loaded; the engine is being attached
        waiting = details["waiting_for"] = {"engine": "starting"}
    raise ApiError(503, "not_ready", Readiness.summary(waiting), headers={"Retry-After": "5"}, **details)


EngineDep = Annotated[Engine, Depends(get_engine)]


def require_token(request: Request, services: ServicesDep) -> Principal:
    """The caller (`auth.Principal`), from `Authorization: Bearer <token>` (or the job pages' session
    cookie, `api/cookies.py`) when tokens are configured (401 otherwise); kept on
    `request.state.principal` for the routes and audits."""
    principal = identify(services.auth, services.cookies, request.headers.get("authorization"),
                         request.cookies.get(COOKIE))
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(require_token)]


def permit(allowed: frozenset[str], what: str, *, cluster_wide: bool = False) -> Callable[..., Principal]:
    """A dependency: the caller, when its role may do `what` (403 otherwise); `cluster_wide`: what
    concerns every tenant, so only for a token without a tenant."""

    def check(principal: PrincipalDep, services: ServicesDep) -> Principal:
        services.auth.check(principal, allowed, what, cluster_wide=cluster_wide)
        return principal

    return check


def job_id_param(
    job_id: Annotated[str, Path(description="the job's id; a tenant's job is <tenant>:<name> (a token of that "
                                            "tenant may say <name>)", examples=["train-7b-run42"],
                                json_schema_extra={"pattern": JOB_ID_PATTERN})],
) -> str:
    return check_job_id(job_id)


JobId = Annotated[str, Depends(job_id_param)]


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}
