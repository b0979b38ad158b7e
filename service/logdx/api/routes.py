"""The routes: thin, over `JobManager` (jobs), `IncidentStore` (incidents, reports, feedback)
and the engine (one-shot diagnosis). Bodies of uploads are streamed: read chunk by chunk with
`request.stream()`, each chunk parsed, spooled and fed in a worker thread as it arrives."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Body, Depends, Query, Request, Response
from starlette.requests import ClientDisconnect

from logdx.act.report import Report
from logdx.api import schemas
from logdx.api.deps import EngineDep, JobId, ServicesDep, get_engine, require_token, retry_after
from logdx.api.errors import ApiError, ErrorBody
from logdx.api.ingest import Batch, Decoder, Format, Source, make_parser, pick_format, source_from_headers
from logdx.api.jobs import IngestRequest
from logdx.api.metrics import CONTENT_TYPE
from logdx.api.services import Services
from logdx.incidents import IncidentError, IncidentIn
from logdx.pipeline import Session

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 415, 422, 429, 503)
}
_DRAIN_BYTES = 4 << 20  # after a mid-stream error, read this much more so the client sees the answer
_DRAIN_SECONDS = 2.0

health = APIRouter(tags=["health"])
api = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=_ERRORS)
metrics_router = APIRouter(dependencies=[Depends(require_token)], tags=["health"])


# --- health and metrics --------------------------------------------------------------------------


@health.get("/healthz", response_model=schemas.Health, summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@health.get("/readyz", response_model=schemas.Ready, responses={503: {"model": ErrorBody}},
            summary="Readiness: rules (and models) loaded, database open")
async def readyz(services: ServicesDep) -> dict[str, Any]:
    engine = get_engine(services)
    return {"status": "ready", "rules": len(engine.rules.rules), "recovering_jobs": services.recovering}


@metrics_router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    body = await services.run(services.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)


# --- uploads ---------------------------------------------------------------------------------------


def _too_large(limit: int) -> ApiError:
    return ApiError(413, "request_too_large", f"the body is larger than server.max_request_bytes ({limit})")


def _upload(request: Request, fmt: str | None, limit: int) -> tuple[Format, Source, Decoder]:
    """What a log upload's headers say: its format, the source its lines share, its decoder. A declared
    length over the limit is refused before any of the body is read."""
    fmt_ = pick_format(request.headers.get("content-type"), fmt)
    source = source_from_headers(request.headers)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    return fmt_, source, Decoder(request.headers.get("content-encoding"), limit)


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    key = key.strip()
    if not (0 < len(key) <= 200) or not key.isprintable():
        raise ApiError(400, "bad_header", "Idempotency-Key must be 1..200 printable characters")
    return key


async def _drain(request: Request) -> None:
    """Read (and drop) what is left of the body, within bounds, so an HTTP/1.1 client that is
    still sending gets to read the error instead of a reset connection."""
    received = 0
    with anyio.move_on_after(_DRAIN_SECONDS):
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > _DRAIN_BYTES:
                    return
        except (ClientDisconnect, RuntimeError):
            return


_TEXT_DESCRIPTION = """\
The body is streamed (chunked transfer encoding welcome) and processed as it arrives.

- `text/plain` (or no Content-Type): log lines; `X-Logdx-Rank`, `X-Logdx-Host`, `X-Logdx-Stream`
  describe every line of the request.
- `application/x-ndjson` / `application/json`: records `{"line"|"log"|"message"|"msg": ...,
  "rank", "host", "ts"|"timestamp"|"date"}` one per line, concatenated, or in one JSON array
  (Fluent Bit `format json|json_lines|json_stream`, Vector `encoding.codec = "json"`).
- `Content-Encoding: gzip` (or a gzip body recognised by its magic bytes).

Lines are durable (spooled and fsync'd) before the 2xx. Send `Idempotency-Key` to make retries
safe. A 4xx after part of the body was read says how many lines were accepted
(`error.accepted_lines`).
"""


@api.post("/jobs/{job_id}/logs", response_model=schemas.IngestResponse, tags=["jobs"],
          summary="Stream a job's log lines", description=_TEXT_DESCRIPTION,
          openapi_extra={"requestBody": {"content": {
              "text/plain": {"schema": {"type": "string"}},
              "application/x-ndjson": {"schema": {"type": "string"}},
              "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
          }}})
async def post_logs(
    request: Request,
    job_id: JobId,
    services: ServicesDep,
    _engine: EngineDep,
    fmt: Annotated[Literal["text", "json"] | None, Query(alias="format", description="override Content-Type")] = None,
) -> dict[str, Any]:
    settings = services.settings
    limit = settings.server.max_request_bytes
    fmt_, source, decoder = _upload(request, fmt, limit)
    key = _idempotency_key(request)
    jobs = services.jobs
    job = await services.run(jobs.get_or_create, job_id)
    await services.run(jobs.check_open, job)
    wait = job.bucket.wait_s()
    if wait > 0:
        services.metrics.rejected.labels("rate_limited").inc()
        raise ApiError(429, "rate_limited",
                       f"job {job_id} is over its rate limit ({settings.server.rate_limit_lines_per_s:g} lines/s)",
                       headers=retry_after(wait), retry_after_s=round(wait, 2))
    if key is not None:
        previous = await services.run_locked(job, jobs.duplicate_of, job, key)
        if previous is not None:
            await _drain(request)
            return {"job_id": job_id, **previous, "duplicate": True}
        job.inflight_keys.add(key)
    req = IngestRequest(fmt_, decoder, make_parser(fmt_, source, settings.input.max_line_bytes), key)
    job.active += 1
    failure: ApiError | None = None
    disconnected = False
    try:
        try:
            async for chunk in request.stream():
                if not chunk:
                    continue
                req.raw_bytes += len(chunk)
                services.metrics.bytes.labels(fmt_.value).inc(len(chunk))
                if req.raw_bytes > limit:
                    raise _too_large(limit)
                await services.run_locked(job, jobs.ingest_piece, job, req, chunk)
            await services.run_locked(job, jobs.ingest_piece, job, req, None)
        except ApiError as e:
            failure = e
        except ClientDisconnect:
            disconnected = True
        except Exception:
            # A bug, not the client's fault: still close the request in the spool (its lines were
            # fed), then let the catch-all answer 500 and log it.
            await services.run_locked(job, jobs.finish_request, job, req, False)
            raise
        result = await services.run_locked(job, jobs.finish_request, job, req, failure is None and not disconnected)
    finally:
        job.active -= 1
        if key is not None:
            job.inflight_keys.discard(key)
    if disconnected:
        services.metrics.rejected.labels("client_disconnected").inc()
        return {"job_id": job_id, **result}  # nobody is listening; the lines it sent are in
    if failure is not None:
        services.metrics.rejected.labels(failure.code).inc()
        failure.details.setdefault("accepted_lines", req.lines)
        await _drain(request)
        raise failure
    return {"job_id": job_id, **result}


@api.post("/jobs/{job_id}/end", response_model=Report, tags=["jobs"],
          summary="The job ended: final diagnosis (idempotent)")
async def end_job(
    job_id: JobId,
    services: ServicesDep,
    _engine: EngineDep,
    body: Annotated[schemas.EndRequest | None, Body()] = None,
) -> Report:
    job = await services.run(services.jobs.get, job_id)
    if job is None:
        raise ApiError(404, "job_not_found", f"no job {job_id!r}")
    exit_code = body.exit_code if body is not None else None
    return await services.run_locked(job, services.jobs.end, job, exit_code)


@api.post("/diagnose", response_model=Report, tags=["reports"],
          summary="One-shot: a whole log in (streamed), a report out",
          openapi_extra={"requestBody": {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def diagnose(
    request: Request,
    services: ServicesDep,
    engine: EngineDep,
    exit_code: Annotated[int | None, Query(description="the job's exit code, if known")] = None,
    fmt: Annotated[Literal["text", "json"] | None, Query(alias="format")] = None,
) -> Report | Response:
    settings = services.settings
    limit = settings.server.max_request_bytes
    fmt_, source, decoder = _upload(request, fmt, limit)
    parser = make_parser(fmt_, source, settings.input.max_line_bytes)
    session = engine.new_session()
    received = 0

    def piece(data: bytes | None) -> None:
        if data is None:
            tail = decoder.finish()
            _feed(session, parser.feed(tail) if tail else Batch())
            _feed(session, parser.finish())
        else:
            _feed(session, parser.feed(decoder.feed(data)))

    try:
        async for chunk in request.stream():
            received += len(chunk)
            services.metrics.bytes.labels(fmt_.value).inc(len(chunk))
            if received > limit:
                raise _too_large(limit)
            await services.run(piece, chunk)
        await services.run(piece, None)
    except ApiError:
        await _drain(request)
        raise
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is listening
    services.metrics.lines.labels(fmt_.value).inc(session.normalizer.line_no)
    report = await services.run(lambda: session.report(exit_code=exit_code, final=True))
    await services.run(services.jobs.save_report, report, session.last_context)
    services.metrics.reports.labels("oneshot", report.status, report.category or "none").inc()
    services.metrics.stage.labels("diagnose").observe(report.timings_ms.get("diagnose", 0.0) / 1000)
    return report


def _feed(session: Session, batch: Batch) -> None:
    for source, lines in batch.runs:
        feed = session.feed
        for raw in lines:
            feed(raw, source)


# --- jobs ------------------------------------------------------------------------------------------


@api.get("/jobs", response_model=schemas.JobList, tags=["jobs"], summary="Jobs, most recently active first")
def list_jobs(
    services: ServicesDep,
    state: Annotated[Literal["open", "ended"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    return {"jobs": services.jobs.list_jobs(state, limit, offset)}


def _job_or_404(services: Services, job_id: str):  # noqa: ANN202 - Job
    job = services.jobs.get(job_id)
    if job is None:
        raise ApiError(404, "job_not_found", f"no job {job_id!r}")
    return job


@api.get("/jobs/{job_id}", response_model=schemas.JobDetail, tags=["jobs"],
         summary="A job: state, compression figures, last diagnosis, alerts and actions")
def get_job(job_id: JobId, services: ServicesDep, _engine: EngineDep) -> dict[str, Any]:
    job = _job_or_404(services, job_id)
    detail = services.jobs.describe(job)
    detail["alerts"] = [
        {"kind": a["kind"], "destination": a["destination"], "status": a["status"], "attempts": a["attempts"],
         "last_error": a["last_error"]}
        for a in services.outbox.history(job_id)
    ]
    detail["actions"] = [r.to_dict() for r in services.actions.audit(job_id)]
    return detail


@api.get("/jobs/{job_id}/templates", response_model=schemas.TemplateList, tags=["jobs"],
         summary="A job's Drain templates, most frequent first")
def get_templates(
    job_id: JobId,
    services: ServicesDep,
    _engine: EngineDep,
    limit: Annotated[int, Query(ge=1, le=5000)] = 200,
    errors_only: Annotated[bool, Query(description="only error-bearing templates")] = False,
) -> dict[str, Any]:
    job = _job_or_404(services, job_id)
    return services.jobs.templates(job, limit, errors_only)


# --- reports and feedback ------------------------------------------------------------------------


def _report_id(report_id: str) -> str:
    if not (0 < len(report_id) <= 128) or not report_id.isprintable():
        raise ApiError(400, "invalid_report_id", "a report id is 1..128 printable characters")
    return report_id


@api.get("/reports/{report_id}", response_model=Report, tags=["reports"], summary="A stored report")
def get_report(report_id: str, services: ServicesDep) -> Report:
    report = services.jobs.get_report(_report_id(report_id))
    if report is None:
        raise ApiError(404, "report_not_found", f"no report {report_id!r}")
    return report


@api.post("/reports/{report_id}/feedback", response_model=schemas.IncidentOut, tags=["reports"],
          summary="Confirm or correct a report; it becomes an incident retrieval learns from")
def feedback(report_id: str, body: schemas.FeedbackRequest, services: ServicesDep) -> dict[str, Any]:
    _report_id(report_id)
    if services.incidents.get_report(report_id) is None:
        raise ApiError(404, "report_not_found", f"no report {report_id!r}")
    try:
        incident = services.incidents.feedback(report_id, body.category, body.failure_type, body.action, body.note)
    except IncidentError as e:
        raise ApiError(400, "invalid_feedback", str(e)) from None
    return incident.to_json()


# --- incidents -------------------------------------------------------------------------------------


@api.get("/incidents", response_model=schemas.IncidentList, tags=["incidents"], summary="Past incidents")
def list_incidents(
    services: ServicesDep,
    category: Annotated[Literal["infrastructure", "framework", "script"] | None, Query()] = None,
    failure_type: Annotated[str | None, Query(max_length=64)] = None,
    source: Annotated[Literal["seed", "feedback", "import"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    items = services.incidents.list(category=category, failure_type=failure_type, source=source, limit=limit)
    return {"incidents": [i.to_json() for i in items], "count": len(items)}


@api.post("/incidents", response_model=schemas.IncidentOut, status_code=201, tags=["incidents"],
          summary="Add (or replace, by id) an incident")
def add_incident(body: IncidentIn, services: ServicesDep) -> dict[str, Any]:
    try:
        return services.incidents.add(body, source=body.source or "import").to_json()
    except IncidentError as e:
        raise ApiError(400, "invalid_incident", str(e)) from None


@api.get("/incidents/{incident_id}", response_model=schemas.IncidentOut, tags=["incidents"], summary="An incident")
def get_incident(incident_id: str, services: ServicesDep) -> dict[str, Any]:
    incident = services.incidents.get(incident_id)
    if incident is None:
        raise ApiError(404, "incident_not_found", f"no incident {incident_id!r}")
    return incident.to_json()


@api.delete("/incidents/{incident_id}", status_code=204, response_class=Response, tags=["incidents"],
            summary="Delete an incident")
def delete_incident(incident_id: str, services: ServicesDep) -> Response:
    if not services.incidents.remove(incident_id):
        raise ApiError(404, "incident_not_found", f"no incident {incident_id!r}")
    return Response(status_code=204)

