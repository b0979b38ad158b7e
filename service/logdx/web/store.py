"""The job pages' views, stored beside the reports: the page of an ended job is drawn from its view
(its session is gone by then), without reading its log again."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pydantic import ValidationError

from logdx.store import Store, migrate
from logdx.web.render import render_job_body
from logdx.web.view import VIEW_VERSION, JobView, build_view

if TYPE_CHECKING:
    from logdx.act.report import Report
    from logdx.pipeline import Session

log = logging.getLogger("logdx.web")

MIGRATIONS = [
    """
    CREATE TABLE web_job_views (
        job_id     TEXT PRIMARY KEY,
        report_id  TEXT NOT NULL,
        created_at REAL NOT NULL,
        version    INTEGER NOT NULL,
        view       TEXT NOT NULL,
        body       TEXT NOT NULL
    );
    """,
]
PG_MIGRATIONS = [
    """
    CREATE TABLE web_job_views (
        job_id     TEXT PRIMARY KEY,
        report_id  TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        version    INTEGER NOT NULL,
        view       TEXT NOT NULL,
        body       TEXT NOT NULL
    );
    """,
]


class JobViews:
    """One view per job: of its latest stored report."""

    def __init__(self, db: Store) -> None:
        self.db = db
        migrate(db, "web_views", MIGRATIONS, postgres=PG_MIGRATIONS)

    def save_from(self, job_id: str, report: Report, session: Session | None) -> None:
        """The view of `report` from the session that made it. A page is worth less than the
        diagnosis: a failure here is logged, never raised into the pipeline."""
        if session is None:
            return
        try:
            self.save(build_view(job_id, report, session))
        except Exception:  # the diagnosis stands without its page
            log.exception("job %s: could not build its page", job_id)

    def save(self, view: JobView) -> None:
        """The view, and the page's log part rendered from it (what every GET of the page reuses)."""
        self.db.execute(
            "INSERT INTO web_job_views(job_id, report_id, created_at, version, view, body) VALUES (?,?,?,?,?,?)"
            " ON CONFLICT(job_id) DO UPDATE SET report_id = excluded.report_id, created_at = excluded.created_at,"
            " version = excluded.version, view = excluded.view, body = excluded.body",
            (view.job_id, view.report.id, time.time(), VIEW_VERSION, view.model_dump_json(), render_job_body(view)))

    def get(self, job_id: str) -> JobView | None:
        raw = self.db.query_value("SELECT view FROM web_job_views WHERE job_id = ?", (job_id,))
        if raw is None:
            return None
        try:
            view = JobView.model_validate_json(raw)
        except ValidationError:  # written by another version of logdx: drawn from the report alone
            return None
        return view if view.version == VIEW_VERSION else None

    def body(self, job_id: str, report_id: str) -> str | None:
        """The rendered log part of the page of this report, when this version of logdx rendered it."""
        rows = self.db.query("SELECT body FROM web_job_views WHERE job_id = ? AND report_id = ? AND version = ?",
                             (job_id, report_id, VIEW_VERSION))
        return str(rows[0]["body"]) if rows else None

    def forget(self, job_id: str) -> None:
        self.db.execute("DELETE FROM web_job_views WHERE job_id = ?", (job_id,))
