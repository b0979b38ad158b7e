"""Jobs: one streaming session per job, fed by many concurrent uploads, durable across restarts.

Concurrency. A job's session (normaliser, Drain miner, detector) is never used by two threads at
once: every use holds the job's `tlock`. Uploads queue on the job's asyncio lock before they take
a worker thread, so sixty-four streams of one job wait on the event loop, not in the thread pool.

Durability. Lines go to the job's spool (see `spool.py`) as a request's body arrives, and are
applied (fed to the session) when the request completes: its END record is written and fsync'd
before its 2xx. A request that fails or is dropped applies nothing, so its retry counts once. A job
whose session is not in memory (after a restart, evicted to bound memory, or while the engine is
still loading: uploads are spooled meanwhile) is rebuilt by replaying its spool, under the same lock,
on first use; open jobs are also warmed at start-up so an early diagnosis that was due still happens.

Diagnosis. When a root-cause event appears, a diagnosis is scheduled (`early_diagnosis_delay_s`
later, debounced); `/end` makes the final one. Each report whose diagnosis differs from the
job's last one is stored, and the change goes to the `Actor` (actions + alert) with the job's
history (`logdx.act.history`: a failure that follows the job, or no progress, stops the restarts).
The job row keeps the last diagnosis key and the last key acted on, so a restart neither forgets
nor repeats one; keys are what a diagnosis says (never a line number, which a replay shifts).

Hangs. A job that shows only symptoms (watchdog timeouts, no root cause) is diagnosed
`hangs.symptom_settle_s` after they start (the silent or lagging rank is the culprit); a job none of
whose streams sent a line for `hangs.silence_s` is diagnosed as stalled. Neither waits for `/end`.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdx.act.history import AttemptHistory
from logdx.act.policy import AttemptOutcome, restart_verdict
from logdx.act.report import Report
from logdx.api.background import Actor, Effect, Timer
from logdx.api.errors import ApiError
from logdx.api.ingest import CpuBudget
from logdx.api.limits import TokenBucket
from logdx.api.metrics import Metrics
from logdx.api.spool import DATA, END, Commit, InstanceLock, Spool, encode_runs
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
_IDEMPOTENCY_KEYS = 10_000  # per job, most recent


# Fed into a silent job's session so that the diagnosis says "stalled" (the stall-notice rule). Its
# text never changes, so the same hang diagnosed again after a restart is the same diagnosis.
_SILENCE_NOTICE = ("logdx run: training stalled: no progress line for longer than hangs.silence_s "
                   "(logdx serve: every stream of this open job fell silent)")


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
        # With the line bus (api/jobs_cluster.py), on the job's owner: the last stream sequence the
        # session holds, requests whose END has not come yet, their DATA, unsaved changes.
        self.bus_seq = 0
        self.bus_pending: dict[str, dict[str, Any]] = {}
        self.bus_data: dict[int, Any] = {}
        self.bus_fed: int | None = 0  # lines its committed requests fed (None: not counted by its saver)
        self.dirty = False


class JobManager:
    def __init__(self, settings: Settings, db: Database, incidents: IncidentStore, metrics: Metrics) -> None:
        self.settings = settings
        self.db = db
        self.incidents = incidents
        self.metrics = metrics
        migrate(db, COMPONENT, MIGRATIONS, postgres=PG_MIGRATIONS)
        s = settings.server
        self.spool_dir = Path(s.spool_dir) if s.spool_dir else Path(f"{settings.store.path}.spool")
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.instance = InstanceLock(self.spool_dir)
        self.engine: Engine | None = None
        self.actor: Actor | None = None
        self._jobs: dict[str, Job] = {}
        self._registry_lock = threading.Lock()
        self.history = AttemptHistory(db)
        # Node streams joined to jobs (api/nodestreams.py): `before_final(job_id, session, exit_code)`.
        self.node_hooks: Any = None
        self.timer = Timer(self._scheduled_diagnosis).start()
        self.hang_timer = Timer(self._hang_tick, name="logdx-hangs").start()
        self.hang_timer.schedule("hangs", settings.hangs.check_interval_s)

    # -- wiring ------------------------------------------------------------------------------

    def attach(self, engine: Engine, actor: Actor | None) -> None:
        self.engine = engine
        self.actor = actor

    def close(self) -> None:
        self.timer.stop()
        self.hang_timer.stop()
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
        self.db.execute("INSERT INTO api_jobs(job_id, created_at, updated_at) VALUES (?,?,?) ON CONFLICT DO NOTHING",
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
        spool = job.spool or Spool(self._spool_path(job.id))
        spool.reset()
        job.committed.clear()  # rebuilt by the replay, in the spool's order
        replayed = 0
        with spool.locked():
            last = 0
            for rec in spool.records(0):
                last = rec.end
            if last < spool.size():
                log.warning("job %s: cutting a torn record at the end of its spool (offset %d)", job.id, last)
                spool.truncate(last)
            for commit in spool.read_new(last, is_alive=self.instance.is_alive):
                replayed += self._apply_commit(job, session, spool, commit)
        job.session, job.spool = session, spool
        job.ledger_offset = spool.offset
        job.lines = session.lines
        job.queued = 0  # the replay applied them
        job.last_line_at = time.monotonic()  # silence is counted from when this process has the job
        job.templates_count = len(session.templates())
        if replayed:
            dt = time.perf_counter() - t0
            self.metrics.replayed_lines.inc(replayed)
            self.metrics.stage.labels("replay").observe(dt)
            log.info("job %s: replayed %d lines from its spool in %.2fs", job.id, replayed, dt)
        self.db.execute("UPDATE api_jobs SET lines = ? WHERE job_id = ?", (job.lines, job.id))
        self._evict_if_needed(keep=job)
        return session

    def _apply_commit(self, job: Job, session: Session, spool: Spool, commit: Commit) -> int:
        """Feed what an END record commits (the first `n` lines of its request's DATA); note its key.
        A second commit of a key already committed applies nothing (its lines count once)."""
        key = commit.meta.get("k")
        again = bool(key) and key in job.committed
        self._note_end(job, commit.meta)
        if not commit.ok or again:
            return 0
        fed = 0
        for runs in spool.data_runs(commit.starts, commit.lines):
            fed += self._feed_runs(session, runs)
        return fed

    @staticmethod
    def _feed_runs(session: Session, runs: list[tuple[Any, list[bytes]]]) -> int:
        return session.feed_runs((Source(rank=rank, host=host, ts=ts, stream=stream), lines)
                                 for (rank, host, ts, stream), lines in runs)

    @staticmethod
    def _note_end(job: Job, meta: dict[str, Any]) -> None:
        key = meta.get("k")
        if key:
            job.committed[key] = meta.get("res") or {}
            job.committed.move_to_end(key)
            while len(job.committed) > _IDEMPOTENCY_KEYS:
                job.committed.popitem(last=False)

    def _catch_up(self, job: Job) -> None:
        """Apply what other processes committed to the spool (hold `tlock` and the spool lock)."""
        spool, session = job.spool, job.session
        assert spool is not None and session is not None
        size = spool.size()
        if size == spool.offset:
            return
        for commit in spool.read_new(size):
            if self._apply_commit(job, session, spool, commit):
                self._lines_arrived(job)
        if spool.offset < size:  # a writer died mid-record: cut it before appending after it
            spool.truncate(spool.offset)
        job.lines = session.lines

    def _loaded_and_current(self, job: Job) -> Session:
        """The session, with whatever other processes committed applied (hold `tlock`)."""
        session = self._ensure_loaded(job)
        assert job.spool is not None
        with job.spool.locked():
            self._catch_up(job)
        return session

    def _evict_if_needed(self, keep: Job | None) -> None:
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

    def spool_runs(self, job: Job, req: IngestRequest, runs: list[tuple[Source, list[bytes]]], lines: int) -> None:
        """Append a piece of a request's lines to the job's spool; they are applied when it commits."""
        t0 = time.perf_counter()
        with job.tlock:
            if job.state != "open":
                raise ApiError(409, "job_ended", f"job {job.id} has ended")
            if not req.wrote and job.session is not None and job.session.templates_capped:
                raise ApiError(413, "template_limit",
                               f"job {job.id} has {self.settings.compress.max_templates} templates "
                               "(compress.max_templates): its log keeps making new kinds of lines (random text?); "
                               "further uploads are refused")
            if job.spool is None:  # the session is not loaded (or the engine not yet ready): spool only
                job.spool = Spool(self._spool_path(job.id))
            meta, payload = encode_runs(runs)
            with job.spool.locked():
                job.spool.append(DATA, {"r": req.id, "i": self.instance.id, "s": meta}, payload)
            req.lines += lines
            req.wrote = True
        self.metrics.stage.labels("spool").observe(time.perf_counter() - t0)

    def duplicate_of(self, job: Job, key: str) -> dict[str, Any] | None:
        """The result of an earlier, committed request with this Idempotency-Key, if any: from the
        session's replay, or while the engine is still loading from the spool's ledger (its END
        records), so that a retry during start-up is answered as the first request was."""
        with job.tlock:
            if job.state == "open" and self.engine is not None:
                self._ensure_loaded(job)
            elif job.state == "open":
                self._read_ledger(job)
            if key in job.inflight_keys:
                raise ApiError(409, "request_in_progress",
                               "a request with this Idempotency-Key is still being received")
            return job.committed.get(key)

    def _read_ledger(self, job: Job) -> None:
        """Note the keys the spool's END records committed since `ledger_offset`, without replaying
        anything (the engine may still be loading). Hold `tlock`; the spool lock is taken here."""
        if job.session is not None:
            return  # the replay noted them, and commits since are noted as they happen
        if job.spool is None:
            if not self._spool_path(job.id).exists():
                return
            job.spool = Spool(self._spool_path(job.id))
        with job.spool.locked():
            for rec in job.spool.ends(job.ledger_offset):
                self._note_end(job, rec.meta)
                job.ledger_offset = rec.end

    def finish_request(self, job: Job, req: IngestRequest, ok: bool, budget: CpuBudget | None = None) -> dict[str, Any]:
        """Commit (ok) or drop the request: apply its spooled lines, write its END record and fsync
        it; after this a 2xx may be sent. While the engine is loading, the END is written and the
        lines are applied when the session is built (by replaying the spool).

        The lines are applied within `budget` (CPU seconds): past it, the rest is not applied, and
        the END says how many were (`n`), so a replay applies the same ones."""
        need_end = req.wrote or (ok and req.key is not None)
        sync_fd: int | None = None
        with job.tlock:
            if need_end and job.state == "open":
                if job.spool is None:
                    job.spool = Spool(self._spool_path(job.id))
                spool = job.spool
                session = self._ensure_loaded(job) if self.engine is not None else None
                if session is None and ok and req.key is not None:
                    self._read_ledger(job)  # another process (or this one before a crash) may have committed it
                with spool.locked():
                    if session is not None:
                        self._catch_up(job)
                    mine = spool.take_pending(req.id) if session is not None else []
                    if ok and req.key is not None and req.key in job.committed:
                        ok, req.duplicate = False, True  # a retry whose first try committed meanwhile
                    if ok and session is not None:
                        self._apply_own(job, session, spool, req, mine, budget)
                    elif ok:  # the engine is loading: committed now, applied when it is ready
                        req.applied = req.lines
                        job.lines += req.applied
                        job.queued += req.applied
                    result = req.result(job.lines, job.queued)
                    meta: dict[str, Any] = {"r": req.id, "st": "ok" if ok else "aborted", "n": req.applied}
                    if ok and req.key:
                        meta["k"], meta["res"] = req.key, result
                    spool.append(END, meta)
                if ok and req.key:
                    self._note_end(job, meta)
                if session is not None:
                    self._after_feed(job)
                sync_fd = os.dup(spool.fd)  # fsync outside the lock; survives a concurrent close
            job.bytes += req.raw_bytes
            result = req.result(job.lines, job.queued)
        if req.duplicate and req.key is not None:
            result = {**job.committed.get(req.key, result), "duplicate": True}
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
        if req.refused:
            self.metrics.skipped.inc(req.refused)
        return result

    def _apply_own(self, job: Job, session: Session, spool: Spool, req: IngestRequest, starts: list[int],
                   budget: CpuBudget | None) -> None:
        """Feed this process's request's lines (hold `tlock` and the spool lock)."""
        t0 = time.perf_counter()
        truncated_before = session.truncated_lines
        for runs in spool.data_runs(starts):
            if budget is not None and budget.exceeded():
                req.cut = "cpu_limit"
                break
            req.applied += self._feed_runs(session, runs)
            if budget is not None:
                budget.charge()
        req.truncated += session.truncated_lines - truncated_before
        job.lines = session.lines
        if req.applied:
            self._lines_arrived(job)
        job.bucket.take(req.applied)
        self.metrics.stage.labels("feed").observe(time.perf_counter() - t0)
        self.metrics.lines.labels(req.fmt).inc(req.applied)

    @staticmethod
    def _lines_arrived(job: Job) -> None:
        job.last_line_at = time.monotonic()
        job.hang_checked = False

    # -- diagnosis -------------------------------------------------------------------------------

    def _after_feed(self, job: Job) -> None:
        """Schedule a diagnosis when new root-cause events appeared (hold `tlock`)."""
        session = job.session
        if session is None or job.state != "open":
            return
        if not session.take_new_root_causes():
            return
        if job.root_cause_at is None:
            job.root_cause_at = time.time()
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
            session.take_new_root_causes()  # this report has seen them
            if job.root_cause_at is not None and not job.first_report_done:
                self.metrics.root_to_report.observe(max(0.0, time.time() - job.root_cause_at))
            job.first_report_done = True
            self._record_report(job, report, "early")
        # A job waiting for its diagnosis is never evicted: past server.max_sessions, make room now.
        self._evict_if_needed(keep=None)

    # -- hangs ---------------------------------------------------------------------------------------

    def _hang_tick(self, _key: str) -> None:
        try:
            self.check_hangs()
        finally:
            self.hang_timer.schedule("hangs", self.settings.hangs.check_interval_s)

    def check_hangs(self) -> None:
        """Diagnose open jobs that hang: only symptoms for a while, or every stream silent."""
        if self.engine is None:
            return
        now = time.monotonic()
        for job in self.loaded_jobs():
            if job.state != "open" or job.scheduled or not job.tlock.acquire(blocking=False):
                continue
            try:
                self._check_hang(job, now)
            except Exception:
                log.exception("job %s: hang check failed", job.id)
            finally:
                job.tlock.release()

    def _check_hang(self, job: Job, now: float) -> None:
        """(hold `tlock`)"""
        h = self.settings.hangs
        session = job.session
        if session is None or job.last_line_at is None or job.hang_checked or not session.lines:
            return
        if job.diagnosis_key is not None and job.diagnosis_key.startswith("failed"):
            return  # diagnosed already: changes come through root causes and /end
        symptoms_only = not session.root_cause_seen and sum(session.event_counts().values()) > 0
        if symptoms_only and job.symptoms_since is None:
            job.symptoms_since = now
        settled = symptoms_only and job.symptoms_since is not None and now - job.symptoms_since >= h.symptom_settle_s
        silent = h.silence_s > 0 and now - job.last_line_at >= h.silence_s
        if not (settled or silent):
            return
        job.hang_checked = True
        if silent and not settled:
            session.feed(_SILENCE_NOTICE)
        report = session.report(final=False)
        log.info("job %s: %s; diagnosed without waiting for /end: %s/%s", job.id,
                 "only symptoms so far" if settled else f"silent for {now - job.last_line_at:.0f} s",
                 report.category, report.failure_type)
        if report.status == "failed":
            self._record_report(job, report, "early")  # an early diagnosis: the job is still open

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
                " WHERE job_id = ? AND diagnosis_key IS DISTINCT FROM ?", (key, report.id, now, job.id, key)).rowcount > 0
            if not changed and kind != "final":
                job.diagnosis_key = key
                return
            self.save_report(report, job.session.last_context if job.session is not None else None)
            conn.execute(
                "INSERT INTO api_job_reports(report_id, job_id, kind, created_at, diagnosis_key) VALUES (?,?,?,?,?)"
                " ON CONFLICT(report_id) DO UPDATE SET job_id = excluded.job_id, kind = excluded.kind,"
                " created_at = excluded.created_at, diagnosis_key = excluded.diagnosis_key",
                (report.id, job.id, kind, now, key))
            if not changed:
                conn.execute("UPDATE api_jobs SET last_report_id = ?, updated_at = ? WHERE job_id = ?",
                             (report.id, now, job.id))
        job.diagnosis_key, job.last_report_id = key, report.id
        self.metrics.reports.labels(kind, report.status, report.category or "none").inc()
        if changed and report.status == "failed" and key != job.acted_key and self.actor is not None:
            self.actor.submit(self._effect(job, report, key))

    def _effect(self, job: Job, report: Report, key: str) -> Effect:
        """A diagnosis change to act on, with what the job's history says about restarting it."""
        session = job.session
        summary = session.summary() if session is not None else None
        outcome = AttemptOutcome.of(report, summary.progress_lines if summary is not None else None)
        verdict = restart_verdict(self.history.previous(job.id), outcome)
        self.history.record(job.id, outcome)
        hosts = tuple(sorted(summary.hosts)) if summary is not None else ()
        return Effect(job.id, report, key, verdict=verdict, seen_hosts=hosts)

    def _succeeded(self, job: Job, report: Report, exit_code: int | None) -> None:
        """The job ended well: record it, and follow its (and its lineage's) alerts with "resolved"."""
        ok = exit_code == 0 or (exit_code is None and report.status == "healthy")
        progress = job.session.summary().progress_lines if job.session is not None else None
        if not ok:
            if report.status != "failed":
                self.history.record(job.id, AttemptOutcome(None, (), progress))
            return
        earlier = self.history.earlier_failed(job.id)
        self.history.record(job.id, AttemptOutcome(None, (), progress, ok=True))
        if self.actor is not None:
            why = f"job {job.id} succeeded" + (f" (after {', '.join(earlier)} failed)" if earlier else "")
            self.actor.submit(Effect(job.id, None, "", resolved=why, resolved_jobs=(*earlier, job.id)))

    def reopen(self, job_id: str, session: Session, report: Report, what_changed: Callable[[Report | None], str]) -> bool:
        """An ended job diagnosed again (a late node event, api/nodestreams.py): stored and acted on like
        any diagnosis change (one alert per distinct diagnosis), its report saying what changed.
        True when the diagnosis changed."""
        row = self._row(job_id)
        if row is None or row["state"] != "ended":
            return False
        job = Job(job_id, row, self._bucket())
        if diagnosis_key(report) == job.diagnosis_key:
            return False
        note = what_changed(self.get_report(job.last_report_id or ""))
        report.notes.insert(0, note)
        report.explanation = f"{note[:1].upper()}{note[1:]}. {report.explanation}"
        with job.tlock:
            job.session = session
            self._record_report(job, report, "followup")
            job.session = None
        return job.diagnosis_key == diagnosis_key(report)

    def acted(self, job_id: str, key: str) -> None:
        self.db.execute("UPDATE api_jobs SET acted_key = ? WHERE job_id = ?", (key, job_id))
        job = self._jobs.get(job_id)
        if job is not None:
            job.acted_key = key

    def stored_final(self, job: Job) -> Report | None:
        """The final report of a job that has ended (None while it is open); 409 when it ended
        without one."""
        if job.state != "ended" and self.state_in_db(job.id) != "ended":
            return None
        job.state = "ended"
        report = self.get_report(job.last_report_id) if job.last_report_id else None
        if report is None:
            row = self._row(job.id) or {}
            report = self.get_report(row.get("last_report_id") or "")
        if report is None:
            raise ApiError(409, "job_ended", f"job {job.id} has ended")
        return report

    def _final_diagnosis(self, job: Job, session: Session, exit_code: int | None) -> Report:
        """Diagnose the whole job, store it as ended with its figures and templates (hold `tlock`)."""
        if self.node_hooks is not None:  # its hosts' node events join it now (nodestreams.py)
            self.node_hooks.before_final(job.id, session, exit_code)
        report = session.report(exit_code=exit_code, final=True)
        summary = summary_dict(session)
        job.state = "ended"
        job.lines = session.lines
        self._record_report(job, report, "final")
        self._succeeded(job, report, exit_code)
        self.db.execute(
            "UPDATE api_jobs SET state = 'ended', ended_at = ?, exit_code = ?, lines = ?, bytes = bytes + ?,"
            " summary = ?, templates = ?, updated_at = ? WHERE job_id = ?",
            (time.time(), exit_code, job.lines, 0, json.dumps(summary), json.dumps(templates_snapshot(session)),
             time.time(), job.id),
        )
        return report

    def end(self, job: Job, exit_code: int | None) -> Report:
        """The final diagnosis; idempotent (a second call returns the stored final report)."""
        with job.tlock:
            stored = self.stored_final(job)
            if stored is not None:
                return stored
            session = self._loaded_and_current(job)
            report = self._final_diagnosis(job, session, exit_code)
            self.db.execute("UPDATE api_jobs SET bytes = ? WHERE job_id = ?", (job.bytes, job.id))
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

    def _view(self, job: Job) -> tuple[dict[str, Any], dict[str, Any] | None, bool | None, int]:
        """The job's row, compression figures, whether a root cause was seen, and its lines: from
        the session when the job is open (loading it), else as stored (an ended job, or while the
        engine loads: figures come once the lines are applied)."""
        with job.tlock:
            row = self._row(job.id) or {}
            if job.state == "open" and row.get("state") != "ended":
                if self.engine is None:
                    return row, None, None, max(job.lines, row.get("lines", 0))
                session = self._loaded_and_current(job)
                return row, summary_dict(session), session.root_cause_seen, job.lines
        compression = json.loads(row["summary"]) if row.get("summary") else None
        return row, compression, None, row.get("lines", 0)

    def describe(self, job: Job) -> dict[str, Any]:
        """State, compression figures, last diagnosis, report history (loads an open job)."""
        row, compression, root_cause_seen, lines = self._view(job)
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
            "lines": lines,
            "queued_lines": job.queued if self.engine is None else 0,
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
                if self.engine is None:  # nothing applied yet: the lines wait for the engine
                    return {"job_id": job.id, "state": "open", "total": 0, "templates": [],
                            "queued_lines": job.queued}
                session = self._loaded_and_current(job)
                all_t = session.templates()
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
                verdict = restart_verdict(self.history.previous(r["job_id"]), AttemptOutcome.of(report, None))
                yield Effect(r["job_id"], report, r["diagnosis_key"], verdict=verdict)

    def open_job_ids(self) -> list[str]:
        rows = self.db.query("SELECT job_id FROM api_jobs WHERE state = 'open' ORDER BY updated_at DESC LIMIT ?",
                             (self.settings.server.max_sessions,))
        return [r["job_id"] for r in rows]

    def forget(self, job_id: str, unused_since: float) -> bool:
        """Retention: delete a job nobody has touched since `unused_since` (its rows, spool and
        session). False when it is in use or was touched since; the next sweep tries again."""
        job = self._jobs.get(job_id)
        if job is not None and not job.tlock.acquire(blocking=False):
            return False
        try:
            if job is not None and (job.active or job.scheduled):
                return False
            with self.db.transaction() as conn:
                if conn.execute("DELETE FROM api_jobs WHERE job_id = ? AND updated_at < ?",
                                (job_id, unused_since)).rowcount == 0:
                    return False
                conn.execute("DELETE FROM api_job_reports WHERE job_id = ?", (job_id,))
            if job is not None:
                job.state = "ended"  # an upload already holding this Job gets 409, not a lost write
                self._drop_session(job)
                with self._registry_lock:
                    if self._jobs.get(job_id) is job:
                        del self._jobs[job_id]
        finally:
            if job is not None:
                job.tlock.release()
        self._spool_path(job_id).unlink(missing_ok=True)
        return True

    def active_uploads(self) -> int:
        """Uploads in progress, over every job (back to 0 when none is: every path releases them)."""
        with self._registry_lock:
            return sum(job.active for job in self._jobs.values())

    def state_gauges(self) -> dict[str, Any]:
        counts = {r["state"]: float(r["n"]) for r in self.db.query(
            "SELECT state, COUNT(*) AS n FROM api_jobs GROUP BY state")}
        templates = 0
        loaded = self.loaded_jobs()
        for job in loaded:
            if job.tlock.acquire(blocking=False):
                try:
                    if job.session is not None:
                        job.templates_count = len(job.session.templates())
                finally:
                    job.tlock.release()
            templates += job.templates_count
        return {
            "Jobs by state|state:logdx_jobs": {"open": counts.get("open", 0.0), "ended": counts.get("ended", 0.0)},
            "Job sessions held in memory|logdx_sessions_loaded": float(len(loaded)),
            "Drain templates across sessions in memory|logdx_templates": float(templates),
        }
