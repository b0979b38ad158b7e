"""Jobs: one streaming session per job, fed by many concurrent uploads, durable across restarts.

Concurrency. A job's session (normaliser, Drain miner, detector) is never used by two threads at
once: every use holds the job's `tlock`. Uploads queue on the job's asyncio lock before they take
a worker thread, so sixty-four streams of one job wait on the event loop, not in the thread pool.

Durability. Lines go to the job's spool (see `spool.py`) before they are fed; a request's END
record is fsync'd before its 2xx. A job whose session is not in memory (after a restart, or
evicted to bound memory) is rebuilt by replaying its spool, under the same lock, on first use;
open jobs are also warmed at start-up so an early diagnosis that was due still happens.

Diagnosis. When a root-cause event appears, a diagnosis is scheduled (`early_diagnosis_delay_s`
later, debounced); `/end` makes the final one. Each report whose diagnosis differs from the
job's last one is stored, and the change goes to the `Actor` (alert + actions). The job row keeps
the last diagnosis key and the last key acted on, so a restart neither forgets nor repeats one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdx.act.report import Report
from logdx.api.background import Actor, Effect, Timer
from logdx.api.errors import ApiError
from logdx.api.ingest import Batch, Decoder, Format, Parser
from logdx.api.limits import TokenBucket
from logdx.api.metrics import Metrics
from logdx.api.spool import DATA, END, InstanceLock, Spool, decode_runs, encode_runs
from logdx.config import Settings
from logdx.incidents import IncidentStore
from logdx.model import FailureContext, TemplateStats
from logdx.normalize import Source
from logdx.pipeline import Engine, Session
from logdx.store import Database, migrate

log = logging.getLogger("logdx.api")

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

_SNAPSHOT_TEMPLATES = 1000  # templates kept in the database when a job ends
_IDEMPOTENCY_KEYS = 10_000  # per job, most recent


def diagnosis_key(report: Report) -> str:
    """What makes two diagnoses "the same" (the alert outbox dedupes on the same fields)."""
    line = report.root_cause.line_no if report.root_cause else ""
    return "\x1f".join([report.status, report.category or "", report.failure_type or "", str(line)])


def summary_dict(session: Session) -> dict[str, Any]:
    s = session.compressor.summary(bytes_in=session.normalizer.bytes_in, lines_truncated=session.normalizer.truncated)
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
    """One upload in progress."""

    fmt: Format
    decoder: Decoder
    parser: Parser
    key: str | None = None  # Idempotency-Key
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    lines: int = 0
    skipped: int = 0
    truncated: int = 0
    raw_bytes: int = 0
    wrote: bool = False  # appended at least one DATA record

    def result(self, job_lines: int) -> dict[str, Any]:
        return {
            "accepted_lines": self.lines,
            "accepted_bytes": self.raw_bytes,
            "skipped_records": self.skipped,
            "truncated_lines": self.truncated,
            "job_lines": job_lines,
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
        self.lines: int = row["lines"]
        self.bytes: int = row["bytes"]
        self.diagnosis_key: str | None = row["diagnosis_key"]
        self.acted_key: str | None = row["acted_key"]
        self.last_report_id: str | None = row["last_report_id"]
        self.committed: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.inflight_keys: set[str] = set()
        self.active = 0
        self.root_causes_noted = 0
        self.root_cause_at: float | None = None  # wall time the first root-cause line arrived
        self.first_report_done = False
        self.scheduled = False
        self.last_used = time.monotonic()
        self.templates_count = 0


class JobManager:
    def __init__(self, settings: Settings, db: Database, incidents: IncidentStore, metrics: Metrics) -> None:
        self.settings = settings
        self.db = db
        self.incidents = incidents
        self.metrics = metrics
        migrate(db, COMPONENT, MIGRATIONS)
        s = settings.server
        self.spool_dir = Path(s.spool_dir) if s.spool_dir else Path(f"{settings.store.path}.spool")
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.instance = InstanceLock(self.spool_dir)
        self.engine: Engine | None = None
        self.actor: Actor | None = None
        self._jobs: dict[str, Job] = {}
        self._registry_lock = threading.Lock()
        self.timer = Timer(self._scheduled_diagnosis).start()

    # -- wiring ------------------------------------------------------------------------------

    def attach(self, engine: Engine, actor: Actor | None) -> None:
        self.engine = engine
        self.actor = actor

    def close(self) -> None:
        self.timer.stop()
        with self._registry_lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            with job.tlock:
                if job.spool is not None:
                    job.spool.close()
        self.instance.close()

    # -- the registry --------------------------------------------------------------------------

    def _row(self, job_id: str) -> dict[str, Any] | None:
        rows = self.db.query("SELECT * FROM api_jobs WHERE job_id = ?", (job_id,))
        return dict(rows[0]) if rows else None

    def _bucket(self) -> TokenBucket:
        s = self.settings.server
        return TokenBucket(s.rate_limit_lines_per_s, s.rate_limit_burst_lines)

    def get(self, job_id: str) -> Job | None:
        """The job, from memory or the database; None when unknown. Only open jobs are kept in
        the registry (an ended job is read from the database each time)."""
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        row = self._row(job_id)
        if row is None:
            return None
        if row["state"] != "open":
            return Job(job_id, row, self._bucket())
        with self._registry_lock:
            job = self._jobs.get(job_id)
            if job is None:
                job = self._jobs[job_id] = Job(job_id, row, self._bucket())
        return job

    def get_or_create(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job is not None:
            return job
        now = time.time()
        self.db.execute("INSERT OR IGNORE INTO api_jobs(job_id, created_at, updated_at) VALUES (?,?,?)",
                        (job_id, now, now))
        job = self.get(job_id)
        assert job is not None
        return job

    def state_in_db(self, job_id: str) -> str | None:
        return self.db.query_value("SELECT state FROM api_jobs WHERE job_id = ?", (job_id,))

    def loaded_jobs(self) -> list[Job]:
        with self._registry_lock:
            return [j for j in self._jobs.values() if j.session is not None]

    # -- loading: replay the spool -------------------------------------------------------------

    def _spool_path(self, job_id: str) -> Path:
        return self.spool_dir / f"{job_id}.spool"

    def _ensure_loaded(self, job: Job) -> Session:
        """The job's session, replaying its spool if it is not in memory (hold `job.tlock`)."""
        job.last_used = time.monotonic()
        if job.session is not None:
            return job.session
        assert self.engine is not None, "engine not ready"
        t0 = time.perf_counter()
        session = self.engine.new_session()
        spool = Spool(self._spool_path(job.id))
        replayed = 0
        with spool.locked():
            ends: dict[str, dict[str, Any]] = {}
            last = 0
            for rec in spool.records(0):
                if rec.type == END:
                    ends[rec.meta["r"]] = rec.meta
                last = rec.end
            if last < spool.size():
                log.warning("job %s: cutting a torn record at the end of its spool (offset %d)", job.id, last)
                spool.truncate(last)
            for rec in spool.records(0, last):
                if rec.type == DATA:
                    if rec.meta["r"] in ends or self.instance.is_alive(rec.meta.get("i", "")):
                        replayed += self._feed_record(session, rec.meta, rec.payload)
                elif rec.type == END:
                    self._note_end(job, rec.meta)
            spool.offset = last
        job.session, job.spool = session, spool
        job.lines = session.normalizer.line_no
        job.root_causes_noted = 0
        job.templates_count = len(session.compressor.templates())
        if replayed:
            dt = time.perf_counter() - t0
            self.metrics.replayed_lines.inc(replayed)
            self.metrics.stage.labels("replay").observe(dt)
            log.info("job %s: replayed %d lines from its spool in %.2fs", job.id, replayed, dt)
        self.db.execute("UPDATE api_jobs SET lines = ? WHERE job_id = ?", (job.lines, job.id))
        self._evict_if_needed(keep=job)
        return session

    @staticmethod
    def _feed_record(session: Session, meta: dict[str, Any], payload: bytes) -> int:
        n = 0
        feed = session.feed
        for (rank, host, ts, stream), lines in decode_runs(meta["s"], payload):
            source = Source(rank=rank, host=host, ts=ts, stream=stream)
            for raw in lines:
                feed(raw, source)
            n += len(lines)
        return n

    @staticmethod
    def _note_end(job: Job, meta: dict[str, Any]) -> None:
        key = meta.get("k")
        if key:
            job.committed[key] = meta.get("res") or {}
            job.committed.move_to_end(key)
            while len(job.committed) > _IDEMPOTENCY_KEYS:
                job.committed.popitem(last=False)

    def _catch_up(self, job: Job) -> None:
        """Feed what other processes appended to the spool (hold `tlock` and the spool lock)."""
        spool, session = job.spool, job.session
        assert spool is not None and session is not None
        size = spool.size()
        if size == spool.offset:
            return
        for rec in spool.records(spool.offset, size):
            if rec.type == DATA:
                self._feed_record(session, rec.meta, rec.payload)
            else:
                self._note_end(job, rec.meta)
            spool.offset = rec.end
        if spool.offset < size:  # a writer died mid-record: cut it before appending after it
            spool.truncate(spool.offset)
        job.lines = session.normalizer.line_no

    def _loaded_and_current(self, job: Job) -> Session:
        """The session, with whatever other processes appended fed in (hold `tlock`)."""
        session = self._ensure_loaded(job)
        assert job.spool is not None
        with job.spool.locked():
            self._catch_up(job)
        return session

    def _evict_if_needed(self, keep: Job) -> None:
        limit = self.settings.server.max_sessions
        loaded = self.loaded_jobs()
        if len(loaded) <= limit:
            return
        for job in sorted(loaded, key=lambda j: j.last_used):
            if len(loaded) <= limit:
                return
            if job is keep or job.active or job.scheduled or not job.tlock.acquire(blocking=False):
                continue
            try:
                self._drop_session(job)
                loaded.remove(job)
                log.info("job %s: session evicted from memory (max_sessions=%d)", job.id, limit)
            finally:
                job.tlock.release()

    @staticmethod
    def _drop_session(job: Job) -> None:
        job.session = None
        if job.spool is not None:
            job.spool.close()
            job.spool = None

    def warm(self, job: Job) -> None:
        """Load an open job's session now (start-up recovery) and re-check its diagnosis."""
        with job.tlock:
            if job.state != "open":
                return
            self._ensure_loaded(job)
            self._after_feed(job)

    # -- ingestion (worker threads) -------------------------------------------------------------

    def check_open(self, job: Job) -> None:
        state = self.state_in_db(job.id)  # another worker process may have ended it
        if state == "ended" or job.state == "ended":
            job.state = "ended"
            raise ApiError(409, "job_ended", f"job {job.id} has ended; send a new job's lines under a new job id")

    def ingest_piece(self, job: Job, req: IngestRequest, data: bytes | None) -> None:
        """Decode and parse a piece of the body (None: its end), spool and feed its lines."""
        t0 = time.perf_counter()
        if data is None:
            tail = req.decoder.finish()
            batch = req.parser.feed(tail) if tail else Batch()
            last = req.parser.finish()
            batch.runs.extend(last.runs)
            batch.lines += last.lines
            batch.skipped += last.skipped
        else:
            batch = req.parser.feed(req.decoder.feed(data))
        req.skipped += batch.skipped
        t1 = time.perf_counter()
        self.metrics.stage.labels("parse").observe(t1 - t0)
        if not batch.lines:
            return
        with job.tlock:
            if job.state != "open":
                raise ApiError(409, "job_ended", f"job {job.id} has ended")
            session = self._ensure_loaded(job)
            spool = job.spool
            assert spool is not None
            meta, payload = encode_runs(batch.runs)
            t2 = time.perf_counter()
            with spool.locked():
                self._catch_up(job)
                spool.append(DATA, {"r": req.id, "i": self.instance.id, "s": meta}, payload)
            t3 = time.perf_counter()
            truncated_before = session.normalizer.truncated
            for source, lines in batch.runs:
                feed = session.feed
                for raw in lines:
                    feed(raw, source)
            t4 = time.perf_counter()
            req.truncated += session.normalizer.truncated - truncated_before
            req.lines += batch.lines
            req.wrote = True
            job.lines = session.normalizer.line_no
            job.bucket.take(batch.lines)
            self._after_feed(job)
        self.metrics.stage.labels("spool").observe(t3 - t2)
        self.metrics.stage.labels("feed").observe(t4 - t3)
        self.metrics.lines.labels(req.fmt.value).inc(batch.lines)

    def duplicate_of(self, job: Job, key: str) -> dict[str, Any] | None:
        """The result of an earlier, committed request with this Idempotency-Key, if any."""
        with job.tlock:
            if job.state == "open":
                self._ensure_loaded(job)
            if key in job.inflight_keys:
                raise ApiError(409, "request_in_progress",
                               "a request with this Idempotency-Key is still being received")
            return job.committed.get(key)

    def finish_request(self, job: Job, req: IngestRequest, ok: bool) -> dict[str, Any]:
        """Write the request's END record and fsync it; after this a 2xx may be sent.

        A failed request (4xx mid-stream, client gone) still gets an END ("partial"): the lines it
        delivered were fed to the live session, so a replay must feed them too."""
        need_end = req.wrote or (ok and req.key is not None)
        sync_fd: int | None = None
        with job.tlock:
            if need_end and job.state == "open":
                self._ensure_loaded(job)
                spool = job.spool
                assert spool is not None
                result = req.result(job.lines)
                meta: dict[str, Any] = {"r": req.id, "st": "ok" if ok else "partial", "n": req.lines}
                if ok and req.key:
                    meta["k"], meta["res"] = req.key, result
                with spool.locked():
                    self._catch_up(job)
                    spool.append(END, meta)
                if ok and req.key:
                    self._note_end(job, meta)
                sync_fd = os.dup(spool.fd)  # fsync outside the lock; survives a concurrent close
            job.bytes += req.raw_bytes
            result = req.result(job.lines)
        if sync_fd is not None:
            t0 = time.perf_counter()
            try:
                os.fsync(sync_fd)
            finally:
                os.close(sync_fd)
            self.metrics.stage.labels("fsync").observe(time.perf_counter() - t0)
        self.db.execute(
            "UPDATE api_jobs SET lines = ?, bytes = ?, requests = requests + 1, updated_at = ? WHERE job_id = ?",
            (job.lines, job.bytes, time.time(), job.id),
        )
        if req.truncated:
            self.metrics.truncated.inc(req.truncated)
        if req.skipped:
            self.metrics.skipped.inc(req.skipped)
        return result

    # -- diagnosis -------------------------------------------------------------------------------

    def _after_feed(self, job: Job) -> None:
        """Schedule a diagnosis when new root-cause events appeared (hold `tlock`)."""
        session = job.session
        if session is None or job.state != "open":
            return
        n = len(session.root_cause_events)
        if n <= job.root_causes_noted:
            return
        if job.root_cause_at is None:
            job.root_cause_at = time.time()
        job.root_causes_noted = n
        if not job.scheduled:
            job.scheduled = True
            self.timer.schedule(job.id, self.settings.server.early_diagnosis_delay_s)

    def _scheduled_diagnosis(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        with job.tlock:
            job.scheduled = False
            if job.state != "open" or self.state_in_db(job_id) != "open":
                return
            session = self._loaded_and_current(job)
            report = session.report(final=False)
            job.root_causes_noted = len(session.root_cause_events)
            if job.root_cause_at is not None and not job.first_report_done:
                self.metrics.root_to_report.observe(max(0.0, time.time() - job.root_cause_at))
            job.first_report_done = True
            self._record_report(job, report, "early")

    def _record_report(self, job: Job, report: Report, kind: str) -> None:
        """Store a report when it is final or changes the diagnosis; act on changes (hold `tlock`).

        "Changes" is decided by the job row, atomically (compare-and-set on `diagnosis_key`), so
        that worker processes sharing the database store and act on one change once."""
        key = diagnosis_key(report)
        self.metrics.stage.labels("diagnose").observe(report.timings_ms.get("diagnose", 0.0) / 1000)
        if key == job.diagnosis_key and kind != "final":
            return
        now = time.time()
        with self.db.transaction() as conn:
            changed = conn.execute(
                "UPDATE api_jobs SET diagnosis_key = ?, last_report_id = ?, updated_at = ?"
                " WHERE job_id = ? AND diagnosis_key IS NOT ?", (key, report.id, now, job.id, key)).rowcount > 0
            if not changed and kind != "final":
                job.diagnosis_key = key
                return
            self.save_report(report, job.session.last_context if job.session is not None else None)
            conn.execute(
                "INSERT OR REPLACE INTO api_job_reports(report_id, job_id, kind, created_at, diagnosis_key)"
                " VALUES (?,?,?,?,?)", (report.id, job.id, kind, now, key))
            if not changed:
                conn.execute("UPDATE api_jobs SET last_report_id = ?, updated_at = ? WHERE job_id = ?",
                             (report.id, now, job.id))
        job.diagnosis_key, job.last_report_id = key, report.id
        self.metrics.reports.labels(kind, report.status, report.category or "none").inc()
        if changed and report.status == "failed" and key != job.acted_key and self.actor is not None:
            self.actor.submit(Effect(job.id, report, key))

    def acted(self, job_id: str, key: str) -> None:
        self.db.execute("UPDATE api_jobs SET acted_key = ? WHERE job_id = ?", (key, job_id))
        job = self._jobs.get(job_id)
        if job is not None:
            job.acted_key = key

    def end(self, job: Job, exit_code: int | None) -> Report:
        """The final diagnosis; idempotent (a second call returns the stored final report)."""
        with job.tlock:
            if job.state == "ended" or self.state_in_db(job.id) == "ended":
                job.state = "ended"
                report = self.get_report(job.last_report_id) if job.last_report_id else None
                if report is None:
                    row = self._row(job.id) or {}
                    report = self.get_report(row.get("last_report_id") or "")
                if report is None:
                    raise ApiError(409, "job_ended", f"job {job.id} has ended")
                return report
            session = self._loaded_and_current(job)
            report = session.report(exit_code=exit_code, final=True)
            summary = summary_dict(session)
            templates = sorted(session.compressor.templates(), key=lambda t: -t.count)[:_SNAPSHOT_TEMPLATES]
            snapshot = [template_dict(t) for t in templates]
            job.state = "ended"
            self._record_report(job, report, "final")
            self.db.execute(
                "UPDATE api_jobs SET state = 'ended', ended_at = ?, exit_code = ?, lines = ?, bytes = ?,"
                " summary = ?, templates = ?, updated_at = ? WHERE job_id = ?",
                (time.time(), exit_code, job.lines, job.bytes, json.dumps(summary),
                 json.dumps({"total": summary["templates"], "templates": snapshot}), time.time(), job.id),
            )
            if not self.settings.server.keep_spool and job.spool is not None:
                job.spool.path.unlink(missing_ok=True)
            self._drop_session(job)
        with self._registry_lock:
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]
        return report

    # -- reports ------------------------------------------------------------------------------

    def save_report(self, report: Report, context: FailureContext | None = None) -> None:
        """Stored with the masked failure context, so that feedback on it teaches retrieval."""
        self.incidents.save_report(report.model_dump(mode="json"), context=context)

    def get_report(self, report_id: str) -> Report | None:
        if not report_id:
            return None
        data = self.incidents.get_report(report_id)
        if data is None:
            return None
        data.setdefault("id", report_id)
        data.pop("report_id", None)
        return Report.model_validate(data)

    # -- reading ------------------------------------------------------------------------------

    def describe(self, job: Job) -> dict[str, Any]:
        """State, compression figures, last diagnosis, report history (loads an open job)."""
        with job.tlock:
            row = self._row(job.id) or {}
            if job.state == "open" and row.get("state") != "ended":
                session = self._loaded_and_current(job)
                compression = summary_dict(session)
                root_cause_seen = session.root_cause_seen
            else:
                compression = json.loads(row["summary"]) if row.get("summary") else None
                root_cause_seen = None
        reports = self.db.query(
            "SELECT report_id, kind, created_at FROM api_job_reports WHERE job_id = ? ORDER BY created_at",
            (job.id,))
        last = self.get_report(row.get("last_report_id") or "")
        return {
            "job_id": job.id,
            "state": row.get("state", job.state),
            "created_at": row.get("created_at"),
            "updated_at": row.get("updated_at"),
            "ended_at": row.get("ended_at"),
            "exit_code": row.get("exit_code"),
            "lines": job.lines if job.state == "open" else row.get("lines", 0),
            "bytes": row.get("bytes", 0),
            "requests": row.get("requests", 0),
            "compression": compression,
            "root_cause_seen": root_cause_seen,
            "report": last,
            "reports": [dict(r) for r in reports],
        }

    def templates(self, job: Job, limit: int, errors_only: bool) -> dict[str, Any]:
        with job.tlock:
            row = self._row(job.id) or {}
            if job.state == "open" and row.get("state") != "ended":
                session = self._loaded_and_current(job)
                all_t = session.compressor.templates()
                total = len(all_t)
                chosen = [t for t in all_t if t.error_bearing] if errors_only else all_t
                chosen = sorted(chosen, key=lambda t: -t.count)[:limit]
                return {"job_id": job.id, "state": "open", "total": total,
                        "templates": [template_dict(t) for t in chosen]}
        snap = json.loads(row["templates"]) if row.get("templates") else {"total": 0, "templates": []}
        items = [t for t in snap["templates"] if t["error_bearing"]] if errors_only else snap["templates"]
        return {"job_id": job.id, "state": "ended", "total": snap["total"], "templates": items[:limit]}

    def list_jobs(self, state: str | None, limit: int, offset: int) -> list[dict[str, Any]]:
        sql = ("SELECT j.job_id, j.state, j.created_at, j.updated_at, j.ended_at, j.exit_code, j.lines, j.bytes,"
               " j.last_report_id FROM api_jobs j")
        params: list[Any] = []
        if state:
            sql += " WHERE j.state = ?"
            params.append(state)
        sql += " ORDER BY j.updated_at DESC LIMIT ? OFFSET ?"
        params += [limit, offset]
        out = []
        for r in self.db.query(sql, params):
            item = dict(r)
            live = self._jobs.get(item["job_id"])
            if live is not None and live.state == "open" and live.session is not None:
                item["lines"] = live.lines
            report = self.get_report(item.pop("last_report_id") or "")
            item["diagnosis"] = None if report is None else {
                "report_id": report.id, "status": report.status, "category": report.category,
                "failure_type": report.failure_type, "action": report.action, "confidence": report.confidence,
            }
            out.append(item)
        return out

    # -- start-up recovery ----------------------------------------------------------------------

    def unacted(self) -> Iterator[Effect]:
        """Diagnosis changes stored but not acted on (a crash in between): act on them now."""
        rows = self.db.query(
            "SELECT job_id, diagnosis_key, last_report_id FROM api_jobs WHERE diagnosis_key IS NOT NULL"
            " AND (acted_key IS NULL OR acted_key != diagnosis_key)")
        for r in rows:
            report = self.get_report(r["last_report_id"] or "")
            if report is not None and report.status == "failed":
                yield Effect(r["job_id"], report, r["diagnosis_key"])

    def open_job_ids(self) -> list[str]:
        rows = self.db.query("SELECT job_id FROM api_jobs WHERE state = 'open' ORDER BY updated_at DESC LIMIT ?",
                             (self.settings.server.max_sessions,))
        return [r["job_id"] for r in rows]

    def state_gauges(self) -> dict[str, Any]:
        counts = {r["state"]: float(r["n"]) for r in self.db.query(
            "SELECT state, COUNT(*) AS n FROM api_jobs GROUP BY state")}
        templates = 0
        loaded = self.loaded_jobs()
        for job in loaded:
            if job.tlock.acquire(blocking=False):
                try:
                    if job.session is not None:
                        job.templates_count = len(job.session.compressor.templates())
                finally:
                    job.tlock.release()
            templates += job.templates_count
        return {
            "Jobs by state|state:logdx_jobs": {"open": counts.get("open", 0.0), "ended": counts.get("ended", 0.0)},
            "Job sessions held in memory|logdx_sessions_loaded": float(len(loaded)),
            "Drain templates across sessions in memory|logdx_templates": float(templates),
        }
