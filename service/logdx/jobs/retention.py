"""Retention: what `logdx serve` deletes once it no longer needs it (the `retention` settings).

One sweep at start-up and then every `retention.sweep_interval_s`, in a thread of its own, each kind
after its age setting (0 keeps it forever), in small batches so uploads never wait long for the
database:

- ended jobs (`ended_jobs_days` after they ended) and idle open jobs (no upload for
  `idle_jobs_days`): row, report history, spool and in-memory session (`JobManager.forget`), then
  the job page of each job gone;
- reports (`reports_days`), except those a person gave feedback on and each kept job's last one;
- alerts delivered or given up (`alerts_days`), and their dedupe keys once their job is gone;
- the action audit (`audit_days`, never inside `actions.window_s`, which the cordon budget counts),
  except real cordons, uncordons and breaker events: the record of what logdx did to nodes stays;
- evidence capsules (`capsules_days` after they were written; the cordon's audit row keeps their sha256).

`logdx_retention_deleted_total{kind}` counts what went.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from logdx.act.capsule import expire_capsules
from logdx.config import Settings
from logdx.jobs.manager import JobManager
from logdx.store import Database, Expiry, delete_expired, expired_keys

log = logging.getLogger("logdx.api")

DAY_S = 86400.0
KINDS = ("ended_jobs", "idle_jobs", "reports", "alerts", "audit", "capsules")

ENDED_JOBS = Expiry("api_jobs", "ended_at", "state = 'ended'")
IDLE_JOBS = Expiry("api_jobs", "updated_at", "state = 'open'")
REPORTS = Expiry("reports", "created_at", "feedback IS NULL AND id NOT IN "
                 "(SELECT last_report_id FROM api_jobs WHERE last_report_id IS NOT NULL)")
ALERTS = Expiry("alert_outbox", "done_at", "status != 'pending'")
ALERT_KEYS = Expiry("alert_keys", "created_at", "dedupe_key NOT IN (SELECT dedupe_key FROM alert_outbox)"
                    " AND job_id NOT IN (SELECT job_id FROM api_jobs)")
JOB_PAGES = Expiry("web_job_views", "created_at", "job_id NOT IN (SELECT job_id FROM api_jobs)")  # their job went
AUDIT = Expiry("action_audit", "ts", "NOT (dry_run = 0 AND action IN ('cordon', 'uncordon', 'breaker'))")


class Sweeper:
    """Runs the sweeps; `sweep()` is one, on the clock it was given (tests move it by hand)."""

    def __init__(self, settings: Settings, db: Database, jobs: JobManager,
                 on_deleted: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.db = db
        self.jobs = jobs
        self.on_deleted = on_deleted
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self) -> dict[str, int]:
        """Delete what is past its age; how many of each kind went."""
        r = self.settings.retention
        now = self.clock()
        deleted = dict.fromkeys(KINDS, 0)
        if r.ended_jobs_days:
            deleted["ended_jobs"] = self._forget_jobs(ENDED_JOBS, now - r.ended_jobs_days * DAY_S)
        if r.idle_jobs_days:
            deleted["idle_jobs"] = self._forget_jobs(IDLE_JOBS, now - r.idle_jobs_days * DAY_S)
        delete_expired(self.db, JOB_PAGES, now)
        if r.reports_days:
            deleted["reports"] = delete_expired(self.db, REPORTS, now - r.reports_days * DAY_S)
        if r.alerts_days:
            cutoff = now - r.alerts_days * DAY_S
            deleted["alerts"] = delete_expired(self.db, ALERTS, cutoff)
            delete_expired(self.db, ALERT_KEYS, cutoff)
        if r.audit_days:
            cutoff = min(now - r.audit_days * DAY_S, now - self.settings.actions.window_s)
            deleted["audit"] = delete_expired(self.db, AUDIT, cutoff)
        capsules = self.settings.actions.capsule.dir
        if r.capsules_days and capsules is not None:
            deleted["capsules"] = expire_capsules(capsules, now - r.capsules_days * DAY_S)
        for kind, n in deleted.items():
            if n and self.on_deleted is not None:
                self.on_deleted(kind, n)
        if any(deleted.values()):
            log.info("retention: deleted %s", ", ".join(f"{n} {kind}" for kind, n in deleted.items() if n))
        return deleted

    def _forget_jobs(self, expiry: Expiry, cutoff: float) -> int:
        """Jobs go one by one through their manager (spool and session with the rows); a job in use
        is skipped, and a batch of only such jobs ends the sweep of this kind."""
        forgotten = 0
        while True:
            ids = expired_keys(self.db, expiry, cutoff, "job_id")
            done = sum(self.jobs.forget(job_id, cutoff) for job_id in ids)
            forgotten += done
            if not ids or done < len(ids):
                return forgotten

    # -- the thread ---------------------------------------------------------------------------

    def start(self) -> Sweeper:
        self._thread = threading.Thread(target=self._run, name="logdx-retention", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:  # a failed sweep is retried at the next one, never fatal
                log.exception("retention sweep failed")
            self._stop.wait(self.settings.retention.sweep_interval_s)
