"""The upload endpoints: a job's logs (`/v1/jobs/{id}/logs`), the routed ones that serve many jobs
through one URL (OTLP/HTTP `/v1/logs`, Loki's `/loki/api/v1/push`), and the one-shot diagnosis.

A body is read chunk by chunk (`request.stream()`); each chunk is decoded and parsed in a worker
thread (`ingest.Upload`), its lines spooled per job as they arrive; when the body is complete, each
job's part is committed: its lines applied, its END fsync'd, then the answer. A failed or dropped
request applies nothing. Uploads are accepted while the engine is still loading: the lines are
spooled and applied when it is ready.

With a line bus (`bus.url`) the same calls of the job manager publish the pieces and the commit to
NATS JetStream instead of the spool file, and the answer waits for JetStream's acknowledgement
(`bus_ingest.BusIngest`); the job's owner, maybe another replica, applies them.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import AfterValidator, WithJsonSchema
from starlette.requests import ClientDisconnect

from logdx import formats
from logdx.access.auth import INGEST
from logdx.act.report import Report
from logdx.api.deps import EngineDep, JobId, ServicesDep, permit
from logdx.api.ingest import Upload, make_decoder, open_parser, request_meta
from logdx.api.receiver import Received, Receiver, tenant_of, too_large, watching
from logdx.api.services import Services
from logdx.formats import Format
from logdx.formats.loki import LOKI_PROTOBUF
from logdx.formats.otlp import OTLP_JSON, OTLP_PROTOBUF
from logdx.formats.otlp import response as otlp_response
from logdx.hosts import clean_hostname
from logdx.jobs.budget import CpuBudget
from logdx.wire import schemas
from logdx.wire.errors import ApiError, ErrorBody

T = TypeVar("T")
log = logging.getLogger("logdx.api")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 415, 422, 429, 503)
}
_DRAIN_BYTES = 4 << 20  # after a mid-stream error, read this much more so the client sees the answer
_DRAIN_SECONDS = 2.0


def _known_format(name: str) -> str:
    if name not in formats.accepted_names():
        raise ValueError(f"unknown format: one of {', '.join(formats.accepted_names())}")
    return name


# A format of the registry (logdx.formats), checked and documented from it.
FormatName = Annotated[str, AfterValidator(_known_format),
                       WithJsonSchema({"type": "string", "enum": formats.accepted_names()})]

uploads = APIRouter(dependencies=[Depends(permit(INGEST, "upload logs"))], responses=_ERRORS)


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    key = key.strip()
    if not (0 < len(key) <= 200) or not key.isprintable():
        raise ApiError(400, "bad_header", "Idempotency-Key must be 1..200 printable characters")
    return key


def _open_upload(request: Request, services: Services, job: str | None, fmt: str | None,
                 protobuf: Format | None = None, node_host: str | None = None) -> Upload:
    """What a log upload's headers say: its format and parser, the source its lines share, its
    decoder. A declared length over the limit is refused before any of the body is read."""
    settings = services.settings
    limit = settings.server.max_request_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    meta = request_meta(settings, request.headers, job)
    if node_host is not None:  # a node's own lines: none of them is a job's
        meta.source.host, meta.job_keys = node_host, ()
    name, parser = open_parser(meta, request.headers.get("content-type"), fmt, protobuf)
    decoder = make_decoder(settings, request.headers.get("content-encoding"))
    upload = Upload(name, decoder, parser, CpuBudget(settings.server.max_request_cpu_s))
    meta.tick = upload.check
    return upload


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


async def _settle(request: Request, services: Services, upload: Upload, out: Received) -> None:
    """Count what was refused; raise the request's failure (or a cut: CPU) as its answer."""
    for reason, n in upload.refused.items():
        services.metrics.rejected.labels(reason).inc(n)
    if out.disconnected:
        services.metrics.rejected.labels("client_disconnected").inc()
        return
    cut = next((req.cut for _, req in out.parts.values() if req.cut), None)
    failure = out.failure or (upload.budget.error(out.applied) if cut == "cpu_limit" else None)
    if failure is not None:
        services.metrics.rejected.labels(failure.code).inc()
        failure.details.setdefault("accepted_lines", out.applied)
        await _drain(request)
        raise failure
    refused = sum(upload.refused.values())
    if out.applied + out.node_lines == 0 and refused and not any(req.duplicate for _, req in out.parts.values()):
        raise ApiError(422, "nothing_usable", _refusal_text(upload.refused), refused=upload.refused,
                       accepted_lines=0)


# A record refused for having no text at all (a shipper's heartbeat) loses nothing: counted, not partial.
_NOTHING_LOST = frozenset({"empty"})


def _partial(upload: Upload) -> bool:
    """Whether the answer is a partial one: a record that carried a line was refused (no job, no
    message, malformed...). The accepted lines are in; the body counts both."""
    return any(n and reason not in _NOTHING_LOST for reason, n in upload.refused.items())


def _counted(response: Response, upload: Upload, answer: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer of an upload, with what was refused. A partial batch is a 200 whose body says so
    (`partial`, `refused` by reason) and whose `X-Logdx-Refused` header counts the refused records: log shippers
    retry any other status (Fluent Bit takes 200..205, Fluentd 200 alone, as delivered), and a retried batch would
    apply its accepted lines twice."""
    answer.update(skipped_records=sum(upload.refused.values()), refused=upload.refused, partial=_partial(upload))
    if answer["partial"]:
        response.headers["X-Logdx-Refused"] = str(sum(n for r, n in upload.refused.items() if r not in _NOTHING_LOST))
    return answer


def _refusal_text(refused: dict[str, int]) -> str:
    why = {"no_job": "name no job (URL, X-Logdx-Job, or a job field/label/attribute)",
           "bad_job_id": "name an invalid job id", "no_message": "have no message field",
           "malformed": "are not log entries"}
    parts = [f"{n} {why.get(reason, reason)}" for reason, n in sorted(refused.items())]
    return "no line of the body could be used: records that " + "; ".join(parts)


# --- a job's logs ----------------------------------------------------------------------------------

_UPLOAD_DESCRIPTION = """\
The body is streamed (chunked transfer encoding welcome) and spooled as it arrives; its lines are
applied when it is complete (a dropped request applies nothing; with the same `Idempotency-Key`, a
retry counts once). A live stream — chunked, no Content-Length, no Idempotency-Key (`... | curl -X POST
-T -`) — has what arrived applied every `server.live_commit_s`, so the job is diagnosed while it runs;
a live stream cut off keeps what was applied before the cut.

- `text/plain` (or no Content-Type): log lines; `X-Logdx-Rank`, `X-Logdx-Host`, `X-Logdx-Stream`
  describe every line of the request; CRI container log lines are unwrapped.
- `application/json`, `application/x-ndjson`: JSON records, one per line, concatenated or in one array
  (Fluent Bit, Vector, journald, GELF, ECS, Docker json-file); an OTLP JSON or Loki JSON body is
  recognised by its first key.
- `application/msgpack`: Fluent Bit's default format.
- `application/x-protobuf`: OTLP logs.
- `Content-Encoding: gzip` (or a gzip body recognised by its magic bytes), `deflate`, `zstd`, `snappy`
  (block or framed) or `x-snappy-framed`: inflated a piece at a time and judged on what it produces.
- At most `input.max_records` records (413 `too_many_records`); a record with an empty message makes no
  line (counted in `refused.empty`). A job the server does not know yet is created within the caps on
  new jobs (413 `too_many_jobs`, 429 `job_quota`, 429 `open_jobs_limit`).

Lines are durable (spooled and fsync'd) before the 2xx. A 4xx after part of the body was read
applies none of it (`error.accepted_lines` is 0), except a CPU cut (429 `cpu_limit`), which says how
many lines were applied.
"""
_BODIES = {"requestBody": {"content": {
    "text/plain": {"schema": {"type": "string"}},
    "application/x-ndjson": {"schema": {"type": "string"}},
    "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
    "application/msgpack": {"schema": {"type": "string", "format": "binary"}},
    "application/x-protobuf": {"schema": {"type": "string", "format": "binary"}},
}}}


@uploads.post("/v1/jobs/{job_id}/logs", response_model=schemas.IngestResponse, tags=["jobs"],
              summary="Stream a job's log lines", description=_UPLOAD_DESCRIPTION, openapi_extra=_BODIES)
async def post_logs(
    request: Request,
    response: Response,
    job_id: JobId,
    services: ServicesDep,
    fmt: Annotated[FormatName | None, Query(alias="format", description="override Content-Type")] = None,
) -> dict[str, Any]:
    upload = _open_upload(request, services, job_id, fmt)
    key = _idempotency_key(request)
    receiver = Receiver(request, services, upload, key)
    job, _ = await receiver.open_part(job_id)
    job_id = job.id  # a tenant's job: its qualified id
    if key is not None:
        job.inflight_keys.discard(key)  # the duplicate check below must not see this request itself
        try:
            previous = await services.run_locked(job, services.jobs.duplicate_of, job, key)
        except BaseException:  # a refusal, a store outage, a cancelled request: the part is released alike
            receiver._release()
            raise
        job.inflight_keys.add(key)
        if previous is not None:
            receiver._release()
            await _drain(request)
            return {"job_id": job_id, **previous, "duplicate": True}
    out = await receiver.receive()
    await _settle(request, services, upload, out)
    result = out.results.get(job_id) or {}
    return _counted(response, upload, {"job_id": job_id, **result})


# --- routed: many jobs through one URL -------------------------------------------------------------


def _routed_answer(response: Response, upload: Upload, out: Received) -> dict[str, Any]:
    return _counted(response, upload, {
        "accepted_lines": out.applied,
        "jobs": {job_id: result.get("accepted_lines", 0) for job_id, result in out.results.items()},
        "node_lines": out.node_lines,
    })


@uploads.post("/v1/logs", tags=["shippers"], summary="OpenTelemetry logs (OTLP/HTTP), or any format routed by job",
              response_model=schemas.RoutedIngestResponse | schemas.OtlpExportResponse, openapi_extra=_BODIES,
              description="OTLP/HTTP logs, protobuf or JSON: each record's job comes from `X-Logdx-Job`, else "
                          "its resource or record attributes (`job.id`, `slurm.job.id`, `k8s.job.name`, ..., "
                          "see `input.job_keys`). Answers an `ExportLogsServiceResponse` in the request's "
                          "content type, with `partial_success` when records were refused (200, as OTLP/HTTP "
                          "says). Other formats (text with `X-Logdx-Job`, JSON records, msgpack) are accepted "
                          "too and answered in JSON: `partial` with the counts when some records were refused.")
async def post_otlp_logs(
    request: Request,
    response: Response,
    services: ServicesDep,
    fmt: Annotated[FormatName | None, Query(alias="format", description="override Content-Type")] = None,
) -> Any:
    upload = _open_upload(request, services, None, fmt)
    out = await Receiver(request, services, upload, _idempotency_key(request)).receive()
    await _settle(request, services, upload, out)
    name = upload.format_name
    if name in (OTLP_PROTOBUF.name, OTLP_JSON.name):
        refused = sum(upload.refused.values())
        message = _refusal_text(upload.refused) if refused else ""
        body, media = otlp_response(name == OTLP_PROTOBUF.name, refused, message)
        return Response(body, media_type=media)
    return _routed_answer(response, upload, out)


@uploads.post("/loki/api/v1/push", tags=["shippers"], summary="Loki push (Promtail, Grafana Alloy, ...)",
              status_code=204, response_class=Response, openapi_extra=_BODIES,
              responses={200: {"model": schemas.RoutedIngestResponse,
                               "description": "entries without text were skipped, or some refused (`partial`): the counts"}},
              description="Loki's push API, JSON or snappy protobuf. The job comes from `X-Logdx-Job`, else "
                          "a `job_id` label (any of `input.job_keys`); the host from `host`, `hostname` or "
                          "`node`. Answers 204 as Loki does; 200 with the counts (`partial`) when some entries were "
                          "refused (200 when only empty ones were skipped).")
async def post_loki_push(request: Request, services: ServicesDep) -> Response:
    upload = _open_upload(request, services, None, None, protobuf=LOKI_PROTOBUF)
    out = await Receiver(request, services, upload, _idempotency_key(request)).receive()
    await _settle(request, services, upload, out)
    if upload.refused:
        response = Response(media_type="application/json")
        answer = schemas.RoutedIngestResponse(**_routed_answer(response, upload, out))
        return Response(answer.model_dump_json(), status_code=response.status_code, media_type="application/json")
    return Response(status_code=204)


@uploads.post("/v1/nodes/{host}/logs", response_model=schemas.NodeIngestResponse, tags=["shippers"],
              summary="A node's own log lines (kernel, journald, syslog, driver, health events)",
              openapi_extra=_BODIES,
              description="Lines of one host that belong to no job (every format `/v1/jobs/{id}/logs` takes; "
                          "job fields in the records are ignored). They are kept in the host's node stream, "
                          "bounded (`nodes.*`), and join the timeline of every job that ran on the host, from "
                          "`nodes.lead_s` before its first line there to its end; one that arrives after a job "
                          "ended re-opens its diagnosis within `nodes.reopen_grace_s`. The same lines sent "
                          "to `/v1/logs` or the Loki push without a job, naming a host, go to the same place.")
async def post_node_logs(
    request: Request,
    response: Response,
    host: str,
    services: ServicesDep,
    fmt: Annotated[FormatName | None, Query(alias="format", description="override Content-Type")] = None,
) -> dict[str, Any]:
    name = clean_hostname(host)
    if name is None:
        raise ApiError(422, "bad_host", "the host must be one plain host name (no range, list or spaces)")
    if services.nodes is None:
        raise ApiError(503, "not_ready", "node streams are not open")
    if tenant_of(request):
        raise ApiError(403, "tenant_mismatch", "a node's lines join every job on it: send them with a token "
                       "without a tenant (a cluster-wide shipper)")
    if not request.state.principal.hosts.allows(name):
        raise ApiError(403, "host_not_allowed", f"token {request.state.principal.name!r} may not speak for host {name}: "
                       "a node's lines join every job on it and may cordon it (server.tokens[].hosts, or the "
                       "node's own credential)")
    upload = _open_upload(request, services, None, fmt, node_host=name)
    out = await Receiver(request, services, upload, None, node_host=name).receive()
    await _settle(request, services, upload, out)
    return _counted(response, upload, {"host": name, "node_lines": out.node_lines, "accepted_lines": out.node_lines})


# --- one-shot ------------------------------------------------------------------------------------


@uploads.post("/v1/diagnose", response_model=Report, tags=["reports"],
              summary="One-shot: a whole log in (streamed), a report out", openapi_extra=_BODIES)
async def diagnose(
    request: Request,
    services: ServicesDep,
    engine: EngineDep,
    exit_code: Annotated[int | None, Query(description="the job's exit code, if known")] = None,
    fmt: Annotated[FormatName | None, Query(alias="format")] = None,
) -> Report | Response:
    upload = _open_upload(request, services, "oneshot", fmt)
    session = engine.new_session(vouching=True)
    scope = request.state.principal.hosts  # what the caller may say of hosts: a claim beyond it
    received = 0
    limit = services.settings.server.max_request_bytes

    def feed(chunk: bytes | None) -> None:
        for batch in upload.pieces(chunk):
            upload.budget.start()
            try:
                session.feed_runs((replace(source, scope=scope), lines) for _, source, lines in batch.runs)
            finally:
                upload.budget.charge()
            if upload.budget.exceeded():
                raise upload.budget.error(0)

    try:
        async for chunk in request.stream():
            received += len(chunk)
            services.metrics.bytes.labels(upload.fmt).inc(len(chunk))
            if received > limit:
                raise too_large(limit)
            await services.run(feed, chunk)
        async with watching(request, upload):
            await services.run(feed, None)
    except ApiError:
        await _drain(request)
        raise
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is listening
    services.metrics.lines.labels(upload.fmt).inc(session.lines)
    report = await services.run(lambda: session.report(exit_code=exit_code, final=True))
    await services.run(services.jobs.save_report, report, session.last_context, tenant_of(request))
    services.metrics.reports.labels("oneshot", report.status, report.category or "none").inc()
    services.metrics.stage.labels("diagnose").observe(report.timings_ms.get("diagnose", 0.0) / 1000)
    return report
