"""What failures cost, rolled up across jobs: the `job_costs` table under `logdx costs`,
`logdx nodes --by lost-gpu-hours`, the `logdx_lost_gpu_hours_total` counter.

Each failed report's `cost` (logdx/diagnose/cost.py) is one row per job: a later diagnosis of the same job
replaces it, so a job is counted once. Its GPU-hours are charged to its cause (failure type), its
category and, for an infrastructure failure, its culprit hosts (shared equally when it blames several: a
node answers for its hardware, not for a script's bug). A job whose cost the log did not
give (no timestamps) is counted among the jobs, with no hours, so that what is unknown shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from logdx.act.history import lineage_of
from logdx.act.report import Report
from logdx.model import Category, ProgressSummary
from logdx.store import Store, migrate

__all__ = ["BY", "NO_HOST", "CostBook", "CostRow", "Recorded"]

MIGRATIONS = [
    """
    CREATE TABLE job_costs (
        job_id          TEXT PRIMARY KEY,
        lineage         TEXT NOT NULL,
        attempt         INTEGER NOT NULL,
        report_id       TEXT NOT NULL,
        ts              REAL NOT NULL,
        category        TEXT NOT NULL DEFAULT '',
        failure_type    TEXT NOT NULL DEFAULT '',
        hosts           TEXT NOT NULL DEFAULT '',
        gpus            INTEGER,
        failure_ts      REAL,
        failure_step    REAL,
        checkpoint_step INTEGER,
        since           TEXT NOT NULL DEFAULT '',
        lost_gpu_hours  REAL,
        stood_still_s   REAL,
        back_after_s    REAL,
        earlier_gpu_hours REAL NOT NULL DEFAULT 0,
        notes           TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX job_costs_ts ON job_costs(ts);
    CREATE INDEX job_costs_lineage ON job_costs(lineage, attempt);
    """,
]

PG_MIGRATIONS = [
    """
    CREATE TABLE job_costs (
        job_id          TEXT PRIMARY KEY,
        lineage         TEXT NOT NULL,
        attempt         INTEGER NOT NULL,
        report_id       TEXT NOT NULL,
        ts              DOUBLE PRECISION NOT NULL,
        category        TEXT NOT NULL DEFAULT '',
        failure_type    TEXT NOT NULL DEFAULT '',
        hosts           TEXT NOT NULL DEFAULT '',
        gpus            BIGINT,
        failure_ts      DOUBLE PRECISION,
        failure_step    DOUBLE PRECISION,
        checkpoint_step BIGINT,
        since           TEXT NOT NULL DEFAULT '',
        lost_gpu_hours  DOUBLE PRECISION,
        stood_still_s   DOUBLE PRECISION,
        back_after_s    DOUBLE PRECISION,
        earlier_gpu_hours DOUBLE PRECISION NOT NULL DEFAULT 0,
        notes           TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX job_costs_ts ON job_costs(ts);
    CREATE INDEX job_costs_lineage ON job_costs(lineage, attempt);
    """,
]

BY = ("cause", "category", "node")
NO_HOST = "(no culprit host)"  # the group of failures that blame no node


@dataclass(frozen=True, slots=True)
class CostRow:
    """One group of the roll-up: its jobs, the GPU-hours charged to it, the jobs whose cost is unknown."""

    key: str
    jobs: int
    lost_gpu_hours: float
    unknown: int  # jobs of the group whose log did not give their cost

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What recording a job's cost added to the totals (the counter's increment): 0 when it was known."""

    category: str
    failure_type: str
    added_gpu_hours: float


class CostBook:
    def __init__(self, db: Store, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock
        migrate(db, "costs", MIGRATIONS, postgres=PG_MIGRATIONS)

    def record(self, job_id: str, report: Report) -> Recorded | None:
        """A failed report's cost, replacing the job's earlier one; None when the report has no cost."""
        c = report.cost
        if report.status != "failed" or c is None:
            return None
        category = str(report.category or "")
        failure_type = report.failure_type or ""
        with self.db.transaction() as conn:
            old = conn.execute("SELECT category, failure_type, lost_gpu_hours FROM job_costs WHERE job_id = ?",
                               (job_id,)).fetchone()
            conn.execute(
                "INSERT INTO job_costs(job_id, lineage, attempt, report_id, ts, category, failure_type, hosts, gpus,"
                " failure_ts, failure_step, checkpoint_step, since, lost_gpu_hours, stood_still_s, back_after_s,"
                " earlier_gpu_hours, notes) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(job_id) DO UPDATE SET"
                " report_id = excluded.report_id, ts = excluded.ts, category = excluded.category,"
                " failure_type = excluded.failure_type, hosts = excluded.hosts, gpus = excluded.gpus,"
                " failure_ts = excluded.failure_ts, failure_step = excluded.failure_step,"
                " checkpoint_step = excluded.checkpoint_step,"
                " since = excluded.since, lost_gpu_hours = excluded.lost_gpu_hours,"
                # What the next attempt told (follow) stays when this job's own log does not say it.
                " stood_still_s = COALESCE(excluded.stood_still_s, job_costs.stood_still_s),"
                " back_after_s = COALESCE(excluded.back_after_s, job_costs.back_after_s),"
                " earlier_gpu_hours = excluded.earlier_gpu_hours, notes = excluded.notes",
                (job_id, *lineage_of(job_id), report.id, self.clock(), category, failure_type,
                 ",".join(report.culprits.hosts), c.gpus, c.failure_ts, c.failure_step, c.checkpoint_step, c.since, c.lost_gpu_hours, c.stood_still_s, c.back_after_s,
                 sum(w.lost_gpu_hours or 0.0 for w in c.earlier_attempts), "\n".join(c.notes)[:2000]))
        new = c.lost_gpu_hours or 0.0
        before = 0.0
        if old is not None and (old[0], old[1]) == (category, failure_type):
            before = old[2] or 0.0
        return Recorded(category, failure_type, max(0.0, new - before))

    def follow(self, job_id: str, progress: ProgressSummary, previous: str | None = None) -> bool:
        """A later attempt of a lineage (`NAME.attempt-N`, act/history.py) was read: how long the job stood still
        between the previous attempt's failure and this attempt's first progress line, and when this attempt
        was back at the step where that one failed. Parts the previous row already holds (the restart was in
        its own log) are kept. `previous`: the attempt before, when the caller knows it (`logdx run`). True when
        a row was completed."""
        cols = "SELECT job_id, failure_ts, failure_step, stood_still_s, back_after_s FROM job_costs"
        if previous is not None:
            rows = self.db.query(cols + " WHERE job_id = ?", (previous,))
        else:
            lineage, attempt = lineage_of(job_id)
            if attempt < 2:
                return False
            rows = self.db.query(cols + " WHERE lineage = ? AND attempt = ?", (lineage, attempt - 1))
        first = progress.first_progress_ts()
        if not rows or rows[0]["failure_ts"] is None or first is None:
            return False
        prev = rows[0]
        stood = prev["stood_still_s"] if prev["stood_still_s"] is not None else max(0.0, first - prev["failure_ts"])
        back = prev["back_after_s"]
        if back is None and prev["failure_step"] is not None:
            passed = progress.passed_at(prev["failure_step"])
            back = max(0.0, passed - prev["failure_ts"]) if passed is not None else None
        self.db.execute("UPDATE job_costs SET stood_still_s = ?, back_after_s = ? WHERE job_id = ?",
                        (round(stood, 1), round(back, 1) if back is not None else None, prev["job_id"]))
        return True

    def row(self, job_id: str) -> dict[str, object] | None:
        """The job's own row (`logdx costs --job`)."""
        rows = self.db.query("SELECT * FROM job_costs WHERE job_id = ?", (job_id,))
        if not rows:
            return None
        names = list(rows[0].keys())  # a SQLite row iterates its values, a PostgreSQL one its names
        return {k: rows[0][k] for k in names}

    def rollup(self, by: str, since: float | None = None, limit: int = 100) -> list[CostRow]:
        """GPU-hours lost by cause, category or node (failures recorded since `since`), most first."""
        if by not in BY:
            raise ValueError(f"by must be one of {', '.join(BY)}")
        rows = self.db.query("SELECT category, failure_type, hosts, lost_gpu_hours FROM job_costs WHERE ts >= ?",
                             (since if since is not None else 0.0,))
        groups: dict[str, list[float]] = {}  # key -> [jobs, hours, unknown]
        for r in rows:
            hours = r["lost_gpu_hours"]
            if by == "node":
                if r["category"] != Category.INFRASTRUCTURE:
                    continue  # a node answers for its hardware, not for a script's bug or a model too big
                hosts = [h for h in (r["hosts"] or "").split(",") if h]
                keys, share = (hosts, 1 / len(hosts)) if hosts else ([NO_HOST], 1.0)
            else:
                keys, share = [(r["failure_type"] if by == "cause" else r["category"]) or "(unknown)"], 1.0
            for key in keys:
                g = groups.setdefault(key, [0, 0.0, 0])
                g[0] += 1
                g[1] += (hours or 0.0) * share
                g[2] += hours is None
        out = [CostRow(k, int(g[0]), round(g[1], 3), int(g[2])) for k, g in groups.items()]
        out.sort(key=lambda x: (-x.lost_gpu_hours, -x.jobs, x.key))
        return out[:limit]

    def total(self, since: float | None = None) -> tuple[int, float, int]:
        """(failed jobs, GPU-hours lost, jobs whose cost is unknown) since `since`."""
        rows = self.db.query("SELECT lost_gpu_hours FROM job_costs WHERE ts >= ?", (since if since is not None else 0.0,))
        hours = [r["lost_gpu_hours"] for r in rows]
        return len(hours), round(sum(h for h in hours if h is not None), 3), sum(h is None for h in hours)

    def node_hours(self, since: float | None = None) -> dict[str, float]:
        """GPU-hours charged to each culprit node (for `logdx nodes --by lost-gpu-hours`)."""
        return {r.key: r.lost_gpu_hours for r in self.rollup("node", since, limit=1 << 20)
                if r.key != NO_HOST}
