"""The routes: thin, over `JobManager` (jobs) and `IncidentStore` (incidents, reports, feedback).
The uploads (a job's logs, OTLP, Loki push, the one-shot diagnosis) are in `uploads.py`."""

from __future__ import annotations

import sqlite3
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Response

from logdx.access.auth import INGEST, JOB_READ, OPERATE, READ, Principal, job_not_found, report_not_found
from logdx.act.report import Report
from logdx.api.deps import EngineDep, JobId, ServicesDep, permit, ready_engine, require_token
from logdx.incidents import IncidentError, IncidentIn, SharedIncident
from logdx.jobs.metrics import CONTENT_TYPE
from logdx.wire import schemas
from logdx.wire.errors import ApiError, ErrorBody

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 415, 422, 429, 503)
}
_MAX_OFFSET = 1 << 40  # far past any real list; SQLite's integers stop at 2**63

health = APIRouter(tags=["health"])
api = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=_ERRORS)
# Counters of every tenant's traffic: the cluster's, read with a token without a tenant.
metrics_router = APIRouter(dependencies=[Depends(permit(READ, "read the metrics", cluster_wide=True))],
                           tags=["health"])


# --- health and metrics --------------------------------------------------------------------------


@health.get("/healthz", response_model=schemas.Health, summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@health.get("/readyz", response_model=schemas.Ready, responses={503: {"model": ErrorBody}},
            summary="Readiness: rules (and models) loaded, database and line bus reachable; else what it waits for",
            description="503 `not_ready` names each part not ready yet and why (`error.waiting_for`: "
                        "`{\"llm\": \"converting the packaged LLM once (later runs reuse it)\"}`), with "
                        "every check's state (`error.checks`, as `checks` in the 200).")
async def readyz(services: ServicesDep) -> dict[str, Any]:
    checks = await services.run(services.readiness.checks)
    engine = ready_engine(services, checks)
    return {"status": "ready", "rules": len(engine.rules.rules), "recovering_jobs": services.recovering,
            "checks": {name: c.to_json() for name, c in checks.items()}}


@metrics_router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    body = await services.run(services.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)


# --- uploads: see uploads.py ----------------------------------------------------------------------


@api.post("/jobs/{job_id}/end", response_model=Report, tags=["jobs"],
          summary="The job ended: final diagnosis (idempotent)")
async def end_job(
    job_id: JobId,
    services: ServicesDep,
    _engine: EngineDep,
    principal: Annotated[Principal, Depends(permit(INGEST, "end a job"))],
    body: Annotated[schemas.EndRequest | None, Body()] = None,
) -> Report:
    stored = await services.run(lambda: services.tenants.job_id(principal, job_id, write=True))
    job = await services.run(services.jobs.get, stored)
    if job is None:
        raise job_not_found(job_id)
    exit_code = body.exit_code if body is not None else None
    return await services.run_locked(job, services.jobs.end, job, exit_code)


# --- jobs ------------------------------------------------------------------------------------------


@api.get("/jobs", response_model=schemas.JobList, tags=["jobs"], summary="Jobs, most recently active first")
def list_jobs(
    services: ServicesDep,
    principal: Annotated[Principal, Depends(permit(READ, "list jobs"))],
    state: Annotated[Literal["open", "ended"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=_MAX_OFFSET)] = 0,
) -> dict[str, Any]:
    return {"jobs": services.jobs.list_jobs(state, limit, offset, services.tenant_jobs(principal))}





JobReader = Annotated[Principal, Depends(permit(JOB_READ, "read jobs"))]


@api.get("/jobs/{job_id}", response_model=schemas.JobDetail, tags=["jobs"],
         summary="A job: state, compression figures, last diagnosis, alerts and actions")
def get_job(job_id: JobId, services: ServicesDep, principal: JobReader) -> dict[str, Any]:
    job = services.job_for(principal, job_id)
    detail = services.jobs.describe(job)
    detail["alerts"] = [
        {"kind": a["kind"], "destination": a["destination"], "status": a["status"], "attempts": a["attempts"],
         "last_error": a["last_error"]}
        for a in services.responder.outbox.history(job.id)
    ]
    detail["actions"] = [r.to_dict() for r in services.responder.actions.audit(job.id)]
    return detail


@api.get("/jobs/{job_id}/templates", response_model=schemas.TemplateList, tags=["jobs"],
         summary="A job's Drain templates, most frequent first")
def get_templates(
    job_id: JobId,
    services: ServicesDep,
    principal: JobReader,
    limit: Annotated[int, Query(ge=1, le=5000)] = 200,
    errors_only: Annotated[bool, Query(description="only error-bearing templates")] = False,
) -> dict[str, Any]:
    job = services.job_for(principal, job_id)
    return services.jobs.templates(job, limit, errors_only)


# --- reports and feedback ------------------------------------------------------------------------


def _report_id(report_id: str) -> str:
    if not (0 < len(report_id) <= 128) or not report_id.isprintable():
        raise ApiError(400, "invalid_report_id", "a report id is 1..128 printable characters")
    return report_id


@api.get("/reports/{report_id}", response_model=Report, tags=["reports"], summary="A stored report")
def get_report(report_id: str, services: ServicesDep,
               principal: Annotated[Principal, Depends(permit(READ, "read reports"))]) -> Report:
    services.report_tenant_for(principal, _report_id(report_id))
    report = services.jobs.get_report(report_id)
    if report is None:
        raise report_not_found(report_id)
    return report


@api.post("/reports/{report_id}/feedback", response_model=schemas.IncidentOut, tags=["reports"],
          summary="Confirm or correct a report; it becomes an incident retrieval learns from (operator)",
          description="The incident is the report's tenant's: listed and searched by that tenant's tokens and "
                      "cluster-wide ones, and not retrieved in diagnoses. `share: true` (a cluster-wide "
                      "operator's choice) makes it shared: every tenant sees it and every diagnosis retrieves it.")
def feedback(report_id: str, body: schemas.FeedbackRequest, services: ServicesDep,
             principal: Annotated[Principal, Depends(permit(OPERATE, "give feedback on reports"))]) -> dict[str, Any]:
    services.report_tenant_for(principal, _report_id(report_id))
    if body.share:
        services.auth.check(principal, OPERATE, "share an incident with every tenant", cluster_wide=True)
    try:
        incident = services.incidents.feedback(report_id, body.category, body.failure_type, body.action, body.note,
                                               tenant="" if body.share else None, by_tenant=principal.tenant)
    except SharedIncident as e:
        raise ApiError(403, "forbidden", str(e)) from None
    except IncidentError as e:
        raise ApiError(400, "invalid_feedback", str(e)) from None
    return incident.to_json()


@api.post("/reports/{report_id}/false-alarm", response_model=schemas.FalseAlarmOut, tags=["reports"],
          summary="The job of a failed report did not fail: mark it, and charge no node with it (operator)",
          description="The report's feedback says `false alarm`; the nodes it blamed no longer count it (their "
                      "history and grades); an incident learned from an earlier correction of it is removed; its "
                      "root line's template is silenced (a later report of the same line pages nobody and acts on "
                      "nothing, for actions.false_alarm_silence_days). No 'healthy' incident is learned: the "
                      "verdict of a later log is still its own.")
def false_alarm(report_id: str, body: schemas.FalseAlarmRequest, services: ServicesDep,
                principal: Annotated[Principal, Depends(permit(OPERATE, "give feedback on reports"))]) -> dict[str, Any]:
    from logdx.act.feedback import record_false_alarm

    services.report_tenant_for(principal, _report_id(report_id))
    try:
        done = record_false_alarm(services.incidents, services.settings.actions, report_id, body.note,
                                  by_tenant=principal.tenant)
    except SharedIncident as e:
        raise ApiError(403, "forbidden", str(e)) from None
    except IncidentError as e:
        raise ApiError(400, "invalid_feedback", str(e)) from None
    return {"report_id": done.report_id, "was": done.was, "withdrawn_from": done.withdrawn_from,
            "removed_incident": done.removed_incident, "silence": done.silence.id if done.silence else None,
            "silence_expires_at": done.silence.expires_at if done.silence else None}


# --- incidents -------------------------------------------------------------------------------------


IncidentReader = Annotated[Principal, Depends(permit(READ, "read incidents"))]


def _visible(principal: Principal) -> str | None:
    """Which incidents a caller sees: the shared ones and its tenant's; every one without a tenant."""
    return principal.tenant or None


@api.get("/incidents", response_model=schemas.IncidentList, tags=["incidents"], summary="Past incidents",
         description="The shared incidents and the caller's tenant's (a token without a tenant: every one).")
def list_incidents(
    services: ServicesDep,
    principal: IncidentReader,
    category: Annotated[schemas.KnownCategory | None, Query()] = None,
    failure_type: Annotated[str | None, Query(max_length=64)] = None,
    source: Annotated[Literal["seed", "feedback", "import"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    items = services.incidents.list(category=category, failure_type=failure_type, source=source, limit=limit,
                                    tenant=_visible(principal))
    return {"incidents": [i.to_json() for i in items], "count": len(items)}


@api.post("/incidents", response_model=schemas.IncidentOut, status_code=201, tags=["incidents"],
          summary="Add (or replace, by id) an incident (a cluster-wide operator)",
          dependencies=[Depends(permit(OPERATE, "edit incidents", cluster_wide=True))])
def add_incident(body: IncidentIn, services: ServicesDep) -> dict[str, Any]:
    try:
        return services.incidents.add(body, source=body.source or "import").to_json()
    except IncidentError as e:
        raise ApiError(400, "invalid_incident", str(e)) from None
    except sqlite3.IntegrityError:  # one incident per report: another incident was learned from it
        raise ApiError(409, "report_already_used",
                       f"report {body.report_id!r} is already linked to another incident; give this one "
                       "no report_id, or replace that incident by its id") from None


def _incident_not_found(incident_id: str) -> ApiError:
    return ApiError(404, "incident_not_found", f"no incident {incident_id!r}")


@api.get("/incidents/{incident_id}", response_model=schemas.IncidentOut, tags=["incidents"], summary="An incident")
def get_incident(incident_id: str, services: ServicesDep, principal: IncidentReader) -> dict[str, Any]:
    incident = services.incidents.get(incident_id, tenant=_visible(principal))
    if incident is None:
        raise _incident_not_found(incident_id)
    return incident.to_json()


@api.delete("/incidents/{incident_id}", status_code=204, response_class=Response, tags=["incidents"],
            summary="Delete an incident (operator; a tenant's operator: only its tenant's)")
def delete_incident(incident_id: str, services: ServicesDep,
                    principal: Annotated[Principal, Depends(permit(OPERATE, "edit incidents"))]) -> Response:
    if principal.tenant:
        found = services.incidents.get(incident_id, tenant=principal.tenant)
        if found is None:
            raise _incident_not_found(incident_id)
        if not found.tenant:
            services.auth.check(principal, OPERATE, "delete a shared incident", cluster_wide=True)
        removed = services.incidents.remove_if(incident_id, principal.tenant)
    else:
        removed = services.incidents.remove(incident_id)
    if not removed:
        raise _incident_not_found(incident_id)
    return Response(status_code=204)

