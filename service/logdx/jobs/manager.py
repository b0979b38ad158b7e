"""Jobs: one streaming session per job, fed by many concurrent uploads, durable across restarts.

Concurrency. A job's session (normaliser, Drain miner, detector) is never used by two threads at
once: every use holds the job's `tlock`. Uploads queue on the job's asyncio lock before they take
a worker thread, so sixty-four streams of one job wait on the event loop, not in the thread pool.

Storage. Where lines and sessions live is the `Coordinator`'s (`jobs/coordinator.py`): the spool files of one
process (`jobs/embedded.py`) or the line bus and partition owners of a cluster (`jobs/cluster.py`).
Hang checks are `jobs/hangs.py`; reading a job (figures, templates, the list) is `jobs/jobviews.py`.

Diagnosis. When a root-cause event appears, a diagnosis is scheduled (`early_diagnosis_delay_s`
later, debounced); `/end` makes the final one. Each report whose diagnosis differs from the
job's last one is stored, and the change goes to the `Actor` (actions + alert) with the job's
history (`logdx.act.history`: a failure that follows the job, or no progress, stops the restarts).
The job row keeps the last diagnosis key and the last key acted on, so a restart neither forgets
nor repeats one; keys are what a diagnosis says (never a line number, which a replay shifts).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from logdx import tenancy
from logdx.act.capsule import Evidence
from logdx.act.costs import CostBook
from logdx.act.history import AttemptHistory, lineage_of
from logdx.act.policy import AttemptOutcome, restart_verdict
from logdx.act.report import DegradationBlock, Report
from logdx.config import Settings
from logdx.diagnose.degradations import degradations_in
from logdx.hosts import HostScope
from logdx.incidents import IncidentStore
from logdx.jobs import jobviews
from logdx.jobs.background import Actor, Effect, Timer
from logdx.jobs.budget import CpuBudget
from logdx.jobs.coordinator import Coordinator
from logdx.jobs.hangs import HangWatch
from logdx.jobs.jobstate import (
    COMPONENT,
    MIGRATIONS,
    PG_MIGRATIONS,
    IngestRequest,
    Job,
    diagnosis_key,
    summary_dict,
    template_dict,
    templates_snapshot,
)
from logdx.jobs.limits import TokenBucket
from logdx.jobs.metrics import Metrics
from logdx.model import FT, Category, FailureContext
from logdx.normalize import Source
from logdx.pipeline import Engine, Session
from logdx.store import migrate
from logdx.store_base import Store, StoreError
from logdx.web.store import JobViews
from logdx.wire.errors import ApiError

# The faces import these from here (the job manager's module).
__all__ = ["COMPONENT", "MIGRATIONS", "PG_MIGRATIONS", "IngestRequest", "Job", "JobManager", "template_dict"]

log = logging.getLogger("logdx.api")

_IDEMPOTENCY_KEYS = 10_000  # per job, most recent


@functools.lru_cache(maxsize=256)
def _scope(spec: str) -> HostScope:
    """A spooled run's scope, parsed once per spelling (a node token's, a collector's '*', a tenant's '')."""
    return HostScope.parse([spec]) if spec else HostScope.nowhere()


class JobManager:
    """The jobs of this process: their rows, registry, diagnoses and reads, over a `Coordinator`."""

    def __init__(self, settings: Settings, db: Store, incidents: IncidentStore, metrics: Metrics,
                 coordinator: Callable[[JobManager], Coordinator] | None = None) -> None:
        self.settings = settings
        self.db = db
        self.incidents = incidents
        self.metrics = metrics
        migrate(db, COMPONENT, MIGRATIONS, postgres=PG_MIGRATIONS)
        self.engine: Engine | None = None
        self.actor: Actor | None = None
        self._jobs: dict[str, Job] = {}
        self._registry_lock = threading.Lock()
        self.history = AttemptHistory(db)
        self.costs = CostBook(db)  # what each failed job cost (logdx costs)
        self.views = JobViews(db)  # the job pages (logdx.web)
        if coordinator is None:
            from logdx.jobs.embedded import EmbeddedCoordinator

            coordinator = EmbeddedCoordinator
        self.coord: Coordinator = coordinator(self)
        # Node streams joined to jobs (jobs/nodestreams.py): `before_final(job_id, session, exit_code)`.
        self.node_hooks: Any = None
        self.timer = Timer(self._scheduled_diagnosis).start()
        self.hangs = HangWatch(self)

    # -- wiring ------------------------------------------------------------------------------

    def attach(self, engine: Engine, actor: Actor | None) -> None:
        self.engine = engine
        self.actor = actor

    def close(self) -> None:
        self.timer.stop()
        self.hangs.stop()
        self.coord.close()

    def held_jobs(self) -> list[Job]:
        with self._registry_lock:
            return list(self._jobs.values())

    # -- the registry --------------------------------------------------------------------------

    def row(self, job_id: str) -> dict[str, Any] | None:
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
        row = self.row(job_id)
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


    def registered(self, job_id: str) -> Job | None:
        """The job if it is in the registry (open and used here), without reading the database."""
        return self._jobs.get(job_id)

    def unregister(self, job: Job) -> None:
        with self._registry_lock:
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]


    # -- feeding (the coordinator's appliers) -----------------------------------------------------

    @staticmethod
    def feed_runs(session: Session, runs: list[tuple[Any, list[bytes]]]) -> int:
        return session.feed_runs((Source(rank=rank, host=host, ts=ts, stream=stream, scope=_scope(scope)), lines)
                                 for (rank, host, ts, stream, scope), lines in runs)

    @staticmethod
    def note_end(job: Job, meta: dict[str, Any]) -> None:
        """Remember what a committed request answered under its Idempotency-Key (the latest ones)."""
        key = meta.get("k")
        if key:
            job.committed[key] = meta.get("res") or {}
            job.committed.move_to_end(key)
            while len(job.committed) > _IDEMPOTENCY_KEYS:
                job.committed.popitem(last=False)

    @staticmethod
    def lines_arrived(job: Job) -> None:
        job.last_line_at = time.monotonic()
        job.hang_checked = False

    def warm(self, job: Job) -> None:
        """Load an open job's session now (start-up recovery) and re-check its diagnosis."""
        with job.tlock:
            if job.state != "open":
                return
            self.coord.session(job)
            self.after_feed(job)

    # -- ingestion (worker threads): the coordinator's ----------------------------------------------

    def check_open(self, job: Job) -> None:
        self.coord.check_ingest()
        state = self.state_in_db(job.id)  # another worker process may have ended it
        if state == "ended" or job.state == "ended":
            job.state = "ended"
            raise ApiError(409, "job_ended", f"job {job.id} has ended; send a new job's lines under a new job id")

    def spool_runs(self, job: Job, req: IngestRequest, runs: list[tuple[Source, list[bytes]]], lines: int) -> None:
        self.coord.spool_runs(job, req, runs, lines)

    def duplicate_of(self, job: Job, key: str) -> dict[str, Any] | None:
        return self.coord.duplicate_of(job, key)

    def finish_request(self, job: Job, req: IngestRequest, ok: bool, budget: CpuBudget | None = None) -> dict[str, Any]:
        return self.coord.finish_request(job, req, ok, budget)

    def end(self, job: Job, exit_code: int | None) -> Report:
        """The final diagnosis; idempotent (a second call returns the stored final report)."""
        return self.coord.end(job, exit_code)

    # -- diagnosis -------------------------------------------------------------------------------

    def after_feed(self, job: Job) -> None:
        """Schedule a diagnosis when new root-cause events appeared (hold `tlock`)."""
        session = job.session
        if session is None or job.state != "open":
            return
        self._advise(job, session)
        if not session.take_new_root_causes():
            return
        if job.root_cause_at is None:
            job.root_cause_at = time.time()
        if not job.scheduled:
            job.scheduled = True
            self.timer.schedule(job.id, self.settings.server.early_diagnosis_delay_s)

    def _advise(self, job: Job, session: Session) -> None:
        """What the start-up lines that just arrived say will slow the job: advice, alerted once per kind and host
        (the outbox dedupes across replicas and restarts). Read only when NCCL said something new."""
        words = session.compressor.nccl_setup_words
        if words == job.setup_words or self.actor is None:
            return
        job.setup_words = words
        fresh = [g for g in degradations_in(session.compressor.nccl_setup) if (g.kind, g.host) not in job.advised]
        if not fresh:
            return
        job.advised.update((g.kind, g.host) for g in fresh)
        self.actor.submit(Effect(job.id, None, "", advice=tuple(
            DegradationBlock(kind=g.kind, host=g.host, line_no=g.line_no, text=g.text[:300], effect=g.effect)
            for g in fresh)))

    def _scheduled_diagnosis(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        try:
            self._diagnose_early(job)
        except StoreError as e:
            if not self.coord.store_outage(f"job {job_id}: early diagnosis put off, tried again in 1 s", e):
                raise
            job.scheduled = True
            self.timer.schedule(job_id, 1.0)

    def _diagnose_early(self, job: Job) -> None:
        with job.tlock:
            job.scheduled = False
            if job.state != "open" or self.state_in_db(job.id) != "open":
                return
            session = self.coord.open_session(job)
            if session is None:
                return  # not ours (any more): its owner diagnoses it
            report = session.report(final=False)
            session.take_new_root_causes()  # this report has seen them
            if job.root_cause_at is not None and not job.first_report_done:
                self.metrics.root_to_report.observe(max(0.0, time.time() - job.root_cause_at))
            job.first_report_done = True
            self.record_report(job, report, "early")
        # A job waiting for its diagnosis is never evicted: past server.max_sessions, make room now.
        self.coord.evict_if_needed(keep=None)

    def record_report(self, job: Job, report: Report, kind: str) -> None:
        """Store a report when it is final or changes the diagnosis; act on changes (hold `tlock`).

        "Changes" is decided by the job row, atomically (compare-and-set on `diagnosis_key`), so
        that worker processes sharing the database store and act on one change once."""
        for note in reversed(self.coord.notes(job)):
            if note not in report.notes:
                report.notes.insert(0, note)
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
            self.save_report(report, job.session.last_context if job.session is not None else None,
                             tenancy.split(job.id)[0])
            conn.execute(
                "INSERT INTO api_job_reports(report_id, job_id, kind, created_at, diagnosis_key) VALUES (?,?,?,?,?)"
                " ON CONFLICT(report_id) DO UPDATE SET job_id = excluded.job_id, kind = excluded.kind,"
                " created_at = excluded.created_at, diagnosis_key = excluded.diagnosis_key",
                (report.id, job.id, kind, now, key))
            if not changed:
                conn.execute("UPDATE api_jobs SET last_report_id = ?, updated_at = ? WHERE job_id = ?",
                             (report.id, now, job.id))
        job.diagnosis_key, job.last_report_id = key, report.id
        self.views.save_from(job.id, report, job.session)
        self.metrics.reports.labels(kind, report.status, report.category or "none").inc()
        if report.status == "failed":
            self._charge(job.id, report)
        if job.session is not None and lineage_of(job.id)[1] > 1:
            self._follow(job.id, job.session)
        if changed and report.status == "failed" and key != job.acted_key and self.actor is not None:
            self.actor.submit(self._effect(job, report, key))

    def _charge(self, job_id: str, report: Report) -> None:
        """The failure's cost in `job_costs` and the lost GPU-hours counter (what a re-diagnosis adds, once)."""
        try:
            recorded = self.costs.record(job_id, report)
        except StoreError:
            log.exception("cost of job %s not recorded", job_id)
            return
        if recorded is not None and recorded.added_gpu_hours > 0:
            self.metrics.lost_gpu_hours.labels(recorded.failure_type or FT.UNKNOWN,
                                               recorded.category or Category.UNKNOWN).inc(recorded.added_gpu_hours)

    def _follow(self, job_id: str, session: Session) -> None:
        """A later attempt of a lineage: the previous attempt's standing still and recovery (CostBook.follow)."""
        try:
            self.costs.follow(job_id, session.summary().progress)
        except StoreError:
            log.exception("attempt %s not linked to its previous attempt's cost", job_id)

    def _effect(self, job: Job, report: Report, key: str) -> Effect:
        """A diagnosis change to act on, with what the job's history says about restarting it."""
        session = job.session
        summary = session.summary() if session is not None else None
        outcome = AttemptOutcome.of(report, summary.progress_lines if summary is not None else None)
        verdict = restart_verdict(self.history.previous(job.id), outcome)
        self.history.record(job.id, outcome)
        hosts = tuple(sorted(summary.hosts)) if summary is not None else ()
        recorder = session.recorder if session is not None else None
        evidence = Evidence(recorder=recorder.copy()) if recorder is not None else None
        return Effect(job.id, report, key, verdict=verdict, seen_hosts=hosts, evidence=evidence)

    def _succeeded(self, job: Job, report: Report, exit_code: int | None, session: Session | None = None) -> None:
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
            hosts, runtime_s = _healthy_nodes(session or job.session) if report.status == "healthy" else ((), 0.0)
            self.actor.submit(Effect(job.id, None, "", resolved=why, resolved_jobs=(*earlier, job.id),
                                     healthy=report if hosts else None, healthy_hosts=hosts, runtime_s=runtime_s))

    def reopen(self, job_id: str, session: Session, report: Report, what_changed: Callable[[Report | None], str]) -> bool:
        """An ended job diagnosed again (a late node event, jobs/nodestreams.py): stored and acted on like
        any diagnosis change (one alert per distinct diagnosis), its report saying what changed.
        True when the diagnosis changed."""
        row = self.row(job_id)
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
            self.record_report(job, report, "followup")
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
            row = self.row(job.id) or {}
            report = self.get_report(row.get("last_report_id") or "")
        if report is None:
            raise ApiError(409, "job_ended", f"job {job.id} has ended")
        return report

    def final_diagnosis(self, job: Job, session: Session, exit_code: int | None) -> Report:
        """Diagnose the whole job, store it as ended with its figures and templates (hold `tlock`)."""
        if self.node_hooks is not None:  # its hosts' node events join it now (nodestreams.py)
            self.node_hooks.before_final(job.id, session, exit_code)
        report = session.report(exit_code=exit_code, final=True)
        summary = summary_dict(session)
        job.state = "ended"
        job.lines = session.lines
        self.record_report(job, report, "final")
        self._succeeded(job, report, exit_code, session)
        self.db.execute(
            "UPDATE api_jobs SET state = 'ended', ended_at = ?, exit_code = ?, lines = ?, bytes = bytes + ?,"
            " summary = ?, templates = ?, updated_at = ? WHERE job_id = ?",
            (time.time(), exit_code, job.lines, 0, json.dumps(summary), json.dumps(templates_snapshot(session)),
             time.time(), job.id),
        )
        return report

    # -- reports ------------------------------------------------------------------------------

    def save_report(self, report: Report, context: FailureContext | None = None, tenant: str = "") -> None:
        """Stored with the masked failure context, so that feedback on it teaches retrieval; `tenant`:
        whose it is (a job's report is its job's tenant's)."""
        self.incidents.save_report(report.model_dump(mode="json"), context=context, tenant=tenant)

    def get_report(self, report_id: str) -> Report | None:
        if not report_id:
            return None
        data = self.incidents.get_report(report_id)
        if data is None:
            return None
        data.setdefault("id", report_id)
        data.pop("report_id", None)
        return Report.model_validate(data)

    # -- reading (jobs/jobviews.py) -----------------------------------------------------------------

    def describe(self, job: Job) -> dict[str, Any]:
        return jobviews.describe(self, job)

    def templates(self, job: Job, limit: int, errors_only: bool) -> dict[str, Any]:
        return jobviews.templates(self, job, limit, errors_only)

    def list_jobs(self, state: str | None, limit: int, offset: int,
                  only: tuple[str, list[Any]] | None = None) -> list[dict[str, Any]]:
        """Most recently active first; `only`: a condition on the job row `j` (a tenant's jobs)."""
        return jobviews.list_jobs(self, state, limit, offset, only)

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
                job.drop_session()
                self.unregister(job)
        finally:
            if job is not None:
                job.tlock.release()
        self.coord.forgotten(job_id)
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


def _healthy_nodes(session: Session | None) -> tuple[tuple[str, ...], float]:
    """The hosts a healthy job ran on that a sender who may speak for them named (a claim washes no node's
    grade), and its runtime by its log's own timestamps (0 when they do not say)."""
    if session is None:
        return (), 0.0
    summary = session.summary()
    trusted = summary.trusted_hosts
    hosts = tuple(sorted(h for h in summary.hosts if trusted is None or h in trusted))
    first = summary.first_ts
    # The shorter of the spans to the last stamped line and to the last progress line: a stray stamp (a date a
    # line quotes) never stretches it.
    spans = [t - first for t in (summary.last_ts, summary.progress.last_ts)
             if first is not None and t is not None and t > first]
    return hosts, min(spans) if spans else 0.0
