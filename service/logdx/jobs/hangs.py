"""Hangs of open jobs. A job that shows only symptoms (watchdog timeouts, no root cause) is diagnosed
`hangs.symptom_settle_s` after they start (the silent or lagging rank is the culprit); a job none of
whose streams sent a line for `hangs.silence_s` is diagnosed as stalled. Neither waits for `/end`.
"""

from __future__ import annotations

import logging
import time

from logdx.jobs.background import Timer
from logdx.jobs.jobstate import Job
from logdx.jobs.ports import HangJobs

log = logging.getLogger("logdx.api")

# Fed into a silent job's session so that the diagnosis says "stalled" (the stall-notice rule). Its
# text never changes, so the same hang diagnosed again after a restart is the same diagnosis.
_SILENCE_NOTICE = ("logdx run: training stalled: no progress line for longer than hangs.silence_s "
                   "(logdx serve: every stream of this open job fell silent)")


class HangWatch:
    """Checks the open jobs held here every `hangs.check_interval_s`, on its own timer thread."""

    def __init__(self, jobs: HangJobs) -> None:
        self.jobs = jobs
        self.settings = jobs.settings
        self.timer = Timer(self._hang_tick, name="logdx-hangs").start()
        self.timer.schedule("hangs", self.settings.hangs.check_interval_s)

    def stop(self) -> None:
        self.timer.stop()

    def _hang_tick(self, _key: str) -> None:
        try:
            self.check_hangs()
        finally:
            self.timer.schedule("hangs", self.settings.hangs.check_interval_s)

    def check_hangs(self) -> None:
        """Diagnose open jobs that hang: only symptoms for a while, or every stream silent."""
        if self.jobs.engine is None:
            return
        now = time.monotonic()
        for job in self.jobs.loaded_jobs():
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
            self.jobs.record_report(job, report, "early")  # an early diagnosis: the job is still open
