"""Reading jobs: a job's state, figures and templates, and the list of jobs; from the session when
it is held here, else as stored (an ended job, one another replica owns, or while the engine loads)."""

from __future__ import annotations

import json
from typing import Any

from logdx.jobs.jobstate import Job, summary_dict, template_dict
from logdx.jobs.ports import ViewedJobs
from logdx.pipeline import Session


def _view(jobs: ViewedJobs, job: Job) -> tuple[dict[str, Any], dict[str, Any] | None, bool | None, int]:
    """The job's row, compression figures, whether a root cause was seen, and its lines: from
    the session when the job is open (loading it), else as stored (an ended job, or while the
    engine loads: figures come once the lines are applied)."""
    with job.tlock:
        row = jobs.row(job.id) or {}
        if job.state == "open" and row.get("state") != "ended":
            if jobs.engine is None and jobs.coord.queues_until_ready:
                return row, None, None, max(job.lines, row.get("lines", 0))
            session = jobs.coord.open_session(job)
            if session is not None:
                return row, summary_dict(session), session.root_cause_seen, job.lines
    compression = json.loads(row["summary"]) if row.get("summary") else None
    return row, compression, None, int(row.get("lines") or 0)


def describe(jobs: ViewedJobs, job: Job) -> dict[str, Any]:
    """State, compression figures, last diagnosis, report history (loads an open job)."""
    row, compression, root_cause_seen, lines = _view(jobs, job)
    reports = jobs.db.query(
        "SELECT report_id, kind, created_at FROM api_job_reports WHERE job_id = ? ORDER BY created_at",
        (job.id,))
    last = jobs.get_report(row.get("last_report_id") or "")
    return {
        "job_id": job.id,
        "state": row.get("state", job.state),
        "created_at": row.get("created_at"),
        "updated_at": row.get("updated_at"),
        "ended_at": row.get("ended_at"),
        "exit_code": row.get("exit_code"),
        "lines": lines,
        "queued_lines": job.queued if jobs.engine is None else 0,
        "bytes": row.get("bytes", 0),
        "requests": row.get("requests", 0),
        "compression": compression,
        "root_cause_seen": root_cause_seen,
        "report": last,
        "reports": [dict(r) for r in reports],
        **jobs.coord.details(job),
    }


def templates(jobs: ViewedJobs, job: Job, limit: int, errors_only: bool) -> dict[str, Any]:
    session: Session | None = None
    with job.tlock:
        row = jobs.row(job.id) or {}
        if job.state == "open" and row.get("state") != "ended":
            if jobs.engine is None and jobs.coord.queues_until_ready:  # the lines wait for the engine
                return {"job_id": job.id, "state": "open", "total": 0, "templates": [],
                        "queued_lines": job.queued}
            session = jobs.coord.open_session(job)
        if session is not None:
            all_t = session.templates()
            total = len(all_t)
            chosen = [t for t in all_t if t.error_bearing] if errors_only else all_t
            chosen = sorted(chosen, key=lambda t: -t.count)[:limit]
            return {"job_id": job.id, "state": "open", "total": total,
                    "templates": [template_dict(t) for t in chosen]}
    snap: dict[str, Any] = json.loads(row["templates"]) if row.get("templates") else {"total": 0, "templates": []}
    items = [t for t in snap["templates"] if t["error_bearing"]] if errors_only else snap["templates"]
    return {"job_id": job.id, "state": row.get("state", job.state), "total": snap["total"],
            "templates": items[:limit]}


def list_jobs(jobs: ViewedJobs, state: str | None, limit: int, offset: int,
              only: tuple[str, list[Any]] | None = None) -> list[dict[str, Any]]:
    sql = ("SELECT j.job_id, j.state, j.created_at, j.updated_at, j.ended_at, j.exit_code, j.lines, j.bytes,"
           " j.last_report_id FROM api_jobs j")
    where: list[str] = []
    params: list[Any] = []
    if state:
        where.append("j.state = ?")
        params.append(state)
    if only is not None:
        where.append(only[0])
        params += only[1]
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY j.updated_at DESC LIMIT ? OFFSET ?"
    params += [limit, offset]
    out = []
    for r in jobs.db.query(sql, params):
        item = dict(r)
        live = jobs.registered(item["job_id"])
        if live is not None and live.state == "open" and live.session is not None:
            item["lines"] = live.lines
        report = jobs.get_report(item.pop("last_report_id") or "")
        item["diagnosis"] = None if report is None else {
            "report_id": report.id, "status": report.status, "category": report.category,
            "failure_type": report.failure_type, "action": report.action, "confidence": report.confidence,
        }
        out.append(item)
    return out
