"""Jobs of one process (the default, no `bus.url`): each job's lines in its spool file.

Durability. Lines go to the job's spool (see `spool.py`) as a request's body arrives, and are
applied (fed to the session) when the request completes: its END record is written and fsync'd
before its 2xx. A request that fails or is dropped applies nothing, so its retry counts once. A job
whose session is not in memory (after a restart, evicted to bound memory, or while the engine is
still loading: uploads are spooled meanwhile) is rebuilt by replaying its spool, under the same lock,
on first use; open jobs are also warmed at start-up so an early diagnosis that was due still happens.
Several worker processes may share the spools and the database: each applies what the others
committed before it reads or appends (`_catch_up`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from logdx.act.report import Report
from logdx.jobs.budget import CpuBudget
from logdx.jobs.jobstate import IngestRequest, Job
from logdx.jobs.ports import CoordinatedJobs
from logdx.jobs.spool import DATA, END, Commit, InstanceLock, Spool, encode_runs
from logdx.normalize import Source
from logdx.pipeline import Session
from logdx.store_base import StoreError
from logdx.wire.errors import ApiError

log = logging.getLogger("logdx.api")


class EmbeddedCoordinator:
    """Spool files and sessions in this process (`Coordinator`)."""

    queues_until_ready = True

    def __init__(self, jobs: CoordinatedJobs) -> None:
        self.jobs = jobs
        self.settings = jobs.settings
        self.metrics = jobs.metrics
        s = self.settings.server
        self.spool_dir = Path(s.spool_dir) if s.spool_dir else Path(f"{self.settings.store.path}.spool")
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.instance = InstanceLock(self.spool_dir)

    def close(self) -> None:
        for job in self.jobs.held_jobs():
            with job.tlock:
                if job.spool is not None:
                    job.spool.close()
        self.instance.close()

    # -- loading: replay the spool -------------------------------------------------------------

    def _spool_path(self, job_id: str) -> Path:
        return self.spool_dir / f"{job_id}.spool"

    def _ensure_loaded(self, job: Job) -> Session:
        """The job's session, replaying its spool if it is not in memory (hold `job.tlock`)."""
        job.last_used = time.monotonic()
        if job.session is not None:
            return job.session
        assert self.jobs.engine is not None, "engine not ready"
        t0 = time.perf_counter()
        session = self.jobs.engine.new_session(live=True, vouching=True, evidence=True)
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
        self.jobs.db.execute("UPDATE api_jobs SET lines = ? WHERE job_id = ?", (job.lines, job.id))
        self.evict_if_needed(keep=job)
        return session

    def _apply_commit(self, job: Job, session: Session, spool: Spool, commit: Commit) -> int:
        """Feed what an END record commits (the first `n` lines of its request's DATA); note its key.
        A second commit of a key already committed applies nothing (its lines count once)."""
        key = commit.meta.get("k")
        again = bool(key) and key in job.committed
        self.jobs.note_end(job, commit.meta)
        if not commit.ok or again:
            return 0
        fed = 0
        for runs in spool.data_runs(commit.starts, commit.lines):
            fed += self.jobs.feed_runs(session, runs)
        return fed

    def _catch_up(self, job: Job) -> None:
        """Apply what other processes committed to the spool (hold `tlock` and the spool lock)."""
        spool, session = job.spool, job.session
        assert spool is not None and session is not None
        size = spool.size()
        if size == spool.offset:
            return
        for commit in spool.read_new(size):
            if self._apply_commit(job, session, spool, commit):
                self.jobs.lines_arrived(job)
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

    def evict_if_needed(self, keep: Job | None) -> None:
        limit = self.settings.server.max_sessions
        loaded = self.jobs.loaded_jobs()
        if len(loaded) <= limit:
            return
        for job in sorted(loaded, key=lambda j: j.last_used):
            if len(loaded) <= limit:
                return
            if job is keep or job.active or job.scheduled or not job.tlock.acquire(blocking=False):
                continue
            try:
                job.drop_session()
                loaded.remove(job)
                log.info("job %s: session evicted from memory (max_sessions=%d)", job.id, limit)
            finally:
                job.tlock.release()

    # -- ingestion (worker threads) -------------------------------------------------------------

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
            meta, payload = encode_runs(runs, req.scope)
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
            if job.state == "open" and self.jobs.engine is not None:
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
                self.jobs.note_end(job, rec.meta)
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
                session = self._ensure_loaded(job) if self.jobs.engine is not None else None
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
                    self.jobs.note_end(job, meta)
                if session is not None:
                    self.jobs.after_feed(job)
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
        self.jobs.db.execute(
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
            req.applied += self.jobs.feed_runs(session, runs)
            if budget is not None:
                budget.charge()
        req.truncated += session.truncated_lines - truncated_before
        job.lines = session.lines
        if req.applied:
            self.jobs.lines_arrived(job)
        job.bucket.take(req.applied)
        self.metrics.stage.labels("feed").observe(time.perf_counter() - t0)
        self.metrics.lines.labels(req.fmt).inc(req.applied)

    def end(self, job: Job, exit_code: int | None) -> Report:
        with job.tlock:
            stored = self.jobs.stored_final(job)
            if stored is not None:
                return stored
            session = self.session(job)
            report = self.jobs.final_diagnosis(job, session, exit_code)
            self.jobs.db.execute("UPDATE api_jobs SET bytes = ? WHERE job_id = ?", (job.bytes, job.id))
            if not self.settings.server.keep_spool and job.spool is not None:
                job.spool.path.unlink(missing_ok=True)
            job.drop_session()
        self.jobs.unregister(job)
        return report

    # -- what the shared parts ask ---------------------------------------------------------------

    def session(self, job: Job) -> Session:
        return self._loaded_and_current(job)

    def open_session(self, job: Job) -> Session | None:
        return self._loaded_and_current(job)

    def check_ingest(self) -> None:
        return None  # this process takes uploads

    def store_outage(self, what: str, error: StoreError) -> bool:
        return False  # the database is a file here (or the caller's error)

    def notes(self, job: Job) -> list[str]:
        return []

    def details(self, job: Job) -> dict[str, Any]:
        return {}

    def forgotten(self, job_id: str) -> None:
        self._spool_path(job_id).unlink(missing_ok=True)
