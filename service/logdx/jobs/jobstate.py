"""A job's state: its database rows, what the job manager holds of it in memory (`Job`), one
upload's part for it (`IngestRequest`), and the figures read from its session."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from logdx.act.report import Report
from logdx.jobs.limits import TokenBucket
from logdx.jobs.spool import Spool
from logdx.model import TemplateStats
from logdx.pipeline import Session

COMPONENT = "api_jobs"
MIGRATIONS: list[str] = [
    """
    CREATE TABLE api_jobs (
        job_id         TEXT PRIMARY KEY,
        state          TEXT NOT NULL DEFAULT 'open',
        created_at     REAL NOT NULL,
        updated_at     REAL NOT NULL,
        ended_at       REAL,
        exit_code      INTEGER,
        lines          INTEGER NOT NULL DEFAULT 0,
        bytes          INTEGER NOT NULL DEFAULT 0,
        requests       INTEGER NOT NULL DEFAULT 0,
        last_report_id TEXT,
        diagnosis_key  TEXT,
        acted_key      TEXT,
        summary        TEXT,
        templates      TEXT
    );
    CREATE INDEX api_jobs_state ON api_jobs(state, updated_at);
    CREATE TABLE api_job_reports (
        report_id     TEXT PRIMARY KEY,
        job_id        TEXT NOT NULL,
        kind          TEXT NOT NULL,
        created_at    REAL NOT NULL,
        diagnosis_key TEXT NOT NULL
    );
    CREATE INDEX api_job_reports_job ON api_job_reports(job_id, created_at);
    """,
]

PG_MIGRATIONS: list[str] = [
    """
    CREATE TABLE api_jobs (
        job_id         TEXT PRIMARY KEY,
        state          TEXT NOT NULL DEFAULT 'open',
        created_at     DOUBLE PRECISION NOT NULL,
        updated_at     DOUBLE PRECISION NOT NULL,
        ended_at       DOUBLE PRECISION,
        exit_code      INTEGER,
        lines          BIGINT NOT NULL DEFAULT 0,
        bytes          BIGINT NOT NULL DEFAULT 0,
        requests       BIGINT NOT NULL DEFAULT 0,
        last_report_id TEXT,
        diagnosis_key  TEXT,
        acted_key      TEXT,
        summary        TEXT,
        templates      TEXT
    );
    CREATE INDEX api_jobs_state ON api_jobs(state, updated_at);
    CREATE TABLE api_job_reports (
        report_id     TEXT PRIMARY KEY,
        job_id        TEXT NOT NULL,
        kind          TEXT NOT NULL,
        created_at    DOUBLE PRECISION NOT NULL,
        diagnosis_key TEXT NOT NULL
    );
    CREATE INDEX api_job_reports_job ON api_job_reports(job_id, created_at);
    """,
]

_SNAPSHOT_TEMPLATES = 1000  # templates kept in the database when a job ends


def diagnosis_key(report: Report) -> str:
    """What makes two diagnoses "the same": what they say (status, category, failure type, culprit
    hosts, root line text), never a line number, which shifts when a restart replays the spools."""
    root = report.root_cause.text.strip() if report.root_cause else ""
    hosts = ",".join(sorted(h.lower() for h in report.culprits.hosts))
    return "\x1f".join([report.status, report.category or "", report.failure_type or "", hosts, root])


def summary_dict(session: Session) -> dict[str, Any]:
    s = session.summary()
    return {
        "lines_in": s.lines_in,
        "bytes_in": s.bytes_in,
        "templates": s.templates,
        "lines_kept": s.lines_kept,
        "lines_truncated": s.lines_truncated,
        "world_size": s.world_size,
        "hosts": len(s.hosts),
        "progress_lines": s.progress_lines,
        "first_ts": s.first_ts,
        "last_ts": s.last_ts,
    }


def templates_snapshot(session: Session) -> dict[str, Any]:
    """The most frequent templates, as stored for reading without the session."""
    templates = sorted(session.templates(), key=lambda t: -t.count)[:_SNAPSHOT_TEMPLATES]
    return {"total": session.summary().templates, "templates": [template_dict(t) for t in templates]}


def template_dict(t: TemplateStats, max_ids: int = 64) -> dict[str, Any]:
    return {
        "id": t.template_id,
        "template": t.template,
        "count": t.count,
        "first_line": t.first_line,
        "last_line": t.last_line,
        "sample": t.sample,
        "rank_count": len(t.ranks),
        "ranks": sorted(t.ranks)[:max_ids],
        "host_count": len(t.hosts),
        "hosts": sorted(t.hosts)[:max_ids],
        "kept": t.kept,
        "error_bearing": t.error_bearing,
    }


@dataclass
class IngestRequest:
    """One upload's part for one job, in progress."""

    fmt: str
    key: str | None = None  # Idempotency-Key
    scope: str = ""  # the hosts its sender may speak for (`HostScope.spec`): what its lines say of others is a claim
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    lines: int = 0  # spooled; applied when the request commits
    applied: int = 0
    refused: int = 0  # records of this job that gave no line
    truncated: int = 0
    raw_bytes: int = 0
    wrote: bool = False  # appended at least one DATA record
    duplicate: bool = False  # an earlier request with the same key was committed: nothing applied
    cut: str | None = None  # why fewer lines than spooled were applied (a bound was reached)
    pieces: int = 0  # records published (with the line bus)
    ended: bool = False  # its END record is published (with the line bus)

    def result(self, job_lines: int, queued: int = 0) -> dict[str, Any]:
        return {
            "accepted_lines": self.applied,
            "accepted_bytes": self.raw_bytes,
            "skipped_records": self.refused,
            "truncated_lines": self.truncated,
            "job_lines": job_lines,
            "queued_lines": queued,
        }


class Job:
    def __init__(self, job_id: str, row: dict[str, Any], bucket: TokenBucket) -> None:
        self.id = job_id
        self.alock = asyncio.Lock()  # uploads queue here, on the event loop
        self.tlock = threading.RLock()  # whoever touches the session holds this
        self.session: Session | None = None
        self.spool: Spool | None = None
        self.state: str = row["state"]
        self.bucket = bucket
        self.lines: int = row["lines"]  # received: applied to the session, plus `queued`
        self.queued = 0  # lines committed while the engine was loading: applied when it is ready
        self.bytes: int = row["bytes"]
        self.diagnosis_key: str | None = row["diagnosis_key"]
        self.acted_key: str | None = row["acted_key"]
        self.last_report_id: str | None = row["last_report_id"]
        self.committed: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.ledger_offset = 0  # how far `committed` was read from the spool's END records (not loaded)
        self.inflight_keys: set[str] = set()
        self.active = 0
        self.root_cause_at: float | None = None  # wall time the first root-cause line arrived
        self.first_report_done = False
        self.scheduled = False
        self.last_used = time.monotonic()
        self.templates_count = 0
        self.last_line_at: float | None = None  # monotonic: when lines were last applied
        self.symptoms_since: float | None = None  # monotonic: symptoms (and no root cause) seen since
        self.hang_checked = False  # this silence (or these symptoms) was diagnosed already
        self.setup_words = 0  # NCCL start-up words read for advice (the session's `nccl_setup_words` then)
        self.advised: set[tuple[str, str]] = set()  # (kind, host) of the degradations advised about
        # With the line bus (jobs/cluster.py), on the job's owner: the last stream sequence the
        # session holds, requests whose END has not come yet, their DATA, unsaved changes.
        self.bus_seq = 0
        self.bus_pending: dict[str, dict[str, Any]] = {}
        self.bus_data: dict[int, Any] = {}
        self.bus_fed: int | None = 0  # lines its committed requests fed (None: not counted by its saver)
        self.dirty = False

    def drop_session(self) -> None:
        """Forget the session (and close the spool) held in memory; the job's lines stay stored."""
        self.session = None
        if self.spool is not None:
            self.spool.close()
            self.spool = None
