"""The attempts of a job, as the service sees them: what the restart policy learns from.

`logdx run` keeps its attempts in memory. The service sees each attempt as a job of its own, so it
groups them by name: `NAME.attempt-N`, `NAME-attempt-N`, `NAME_retry-N`, `NAME.restart-N` (and
`NAME-attemptN`...) are attempt N of the lineage NAME; any other job id is attempt 1 of its own
lineage. A restart command that submits attempt N+1 under such a name (`{job_id}` is attempt N)
lets the service judge the next failure against the last one (`logdx.act.policy.restart_verdict`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from logdx.act.policy import AttemptOutcome
from logdx.store import Store, migrate

__all__ = ["AttemptHistory", "lineage_of"]

MIGRATIONS = [
    """
    CREATE TABLE job_attempts (
        job_id         TEXT PRIMARY KEY,
        lineage        TEXT NOT NULL,
        attempt        INTEGER NOT NULL,
        failure_type   TEXT,
        hosts          TEXT NOT NULL DEFAULT '',
        progress_lines INTEGER,
        ok             INTEGER NOT NULL DEFAULT 0,
        ts             REAL NOT NULL
    );
    CREATE INDEX job_attempts_lineage ON job_attempts(lineage, attempt);
    """,
]

PG_MIGRATIONS = [
    """
    CREATE TABLE job_attempts (
        job_id         TEXT PRIMARY KEY,
        lineage        TEXT NOT NULL,
        attempt        INTEGER NOT NULL,
        failure_type   TEXT,
        hosts          TEXT NOT NULL DEFAULT '',
        progress_lines BIGINT,
        ok             INTEGER NOT NULL DEFAULT 0,
        ts             DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX job_attempts_lineage ON job_attempts(lineage, attempt);
    """,
]

_ATTEMPT = re.compile(r"^(?P<lineage>.+?)[._-](?:attempt|retry|restart)[._-]?(?P<n>\d{1,6})$", re.I)


def lineage_of(job_id: str) -> tuple[str, int]:
    """The lineage a job id belongs to, and which attempt of it the job is."""
    m = _ATTEMPT.match(job_id)
    if m is None:
        return job_id, 1
    return m.group("lineage"), int(m.group("n"))


class AttemptHistory:
    def __init__(self, db: Store, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        migrate(db, "attempts", MIGRATIONS, postgres=PG_MIGRATIONS)
        self.clock = clock

    def record(self, job_id: str, outcome: AttemptOutcome) -> None:
        """What this attempt came to (so far: a later diagnosis of the same job replaces it)."""
        lineage, attempt = lineage_of(job_id)
        self.db.execute(
            "INSERT INTO job_attempts(job_id, lineage, attempt, failure_type, hosts, progress_lines, ok, ts)"
            " VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(job_id) DO UPDATE SET failure_type = excluded.failure_type,"
            " hosts = excluded.hosts, progress_lines = excluded.progress_lines, ok = excluded.ok, ts = excluded.ts",
            (job_id, lineage, attempt, outcome.failure_type, ",".join(outcome.hosts), outcome.progress_lines,
             int(outcome.ok), self.clock()),
        )

    def previous(self, job_id: str) -> AttemptOutcome | None:
        """The attempt of the same lineage just before this one, if the service saw it."""
        lineage, attempt = lineage_of(job_id)
        rows = self.db.query(
            "SELECT failure_type, hosts, progress_lines, ok FROM job_attempts WHERE lineage = ? AND attempt < ?"
            " ORDER BY attempt DESC, ts DESC LIMIT 1", (lineage, attempt))
        if not rows:
            return None
        r = rows[0]
        hosts = tuple(h for h in (r["hosts"] or "").split(",") if h)
        return AttemptOutcome(r["failure_type"], hosts, r["progress_lines"], ok=bool(r["ok"]))

    def earlier_failed(self, job_id: str) -> list[str]:
        """Earlier attempts of this job's lineage that failed (their alerts get a "resolved")."""
        lineage, attempt = lineage_of(job_id)
        rows = self.db.query("SELECT job_id FROM job_attempts WHERE lineage = ? AND attempt < ? AND ok = 0"
                             " ORDER BY attempt", (lineage, attempt))
        return [r["job_id"] for r in rows]
