"""Silences: a false alarm keeps its root line's template from paging anyone, or acting on the cluster, again.

A person who calls a report a false alarm (act/feedback.py) says that this kind of line is noise where they run.
The next report whose root line has the same masked template (numbers, ids, hosts and paths masked: the same
line from another node, another step) is still diagnosed as it is — the verdict is the log's, never a person's
earlier word — but nothing is done with it: no alert, no cordon, no restart, and its response says which false
alarm silenced it. A silence lasts `actions.silence_days`; a tenant's silence covers that tenant's jobs only, a
cluster-wide operator's every job. Like Alertmanager's silences: they hold the page, not the truth."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from logdx.act.report import Report
from logdx.incidents import mask_text
from logdx.store import Store, migrate

__all__ = ["Silence", "Silences"]

MIGRATIONS = [
    """
    CREATE TABLE silences (
        id            TEXT PRIMARY KEY,
        root_template TEXT NOT NULL,
        report_id     TEXT NOT NULL,
        tenant        TEXT NOT NULL DEFAULT '',
        note          TEXT NOT NULL DEFAULT '',
        created_at    REAL NOT NULL,
        expires_at    REAL NOT NULL
    );
    CREATE INDEX silences_template ON silences(root_template);
    """,
]
PG_MIGRATIONS = [MIGRATIONS[0].replace("REAL", "DOUBLE PRECISION")]


@dataclass(frozen=True, slots=True)
class Silence:
    id: str
    report_id: str
    note: str
    expires_at: float


class Silences:
    def __init__(self, db: Store, days: float, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.days = days
        self.clock = clock
        migrate(db, "silences", MIGRATIONS, postgres=PG_MIGRATIONS)

    def add(self, root_line: str, report_id: str, *, tenant: str = "", note: str = "") -> Silence | None:
        """Silence the template of a false alarm's root line; None when it has none, or silences last 0 days."""
        template = mask_text(root_line) if root_line else ""
        if not template or self.days <= 0:
            return None
        now = self.clock()
        silence = Silence(f"sil-{uuid.uuid4().hex[:12]}", report_id, note, now + self.days * 86400)
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM silences WHERE report_id = ?", (report_id,))
            conn.execute("INSERT INTO silences (id, root_template, report_id, tenant, note, created_at, expires_at) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (silence.id, template, report_id, tenant, note, now, silence.expires_at))
        return silence

    def matching(self, job_id: str, report: Report) -> Silence | None:
        """The silence a failed report falls under: its root line's template, a silence of its job's tenant (or a
        cluster-wide one), not expired. A report without a root line is never silenced."""
        if report.status != "failed" or report.root_cause is None or not report.root_cause.text:
            return None
        rows = self.db.query("SELECT id, report_id, tenant, note, expires_at FROM silences "
                             "WHERE root_template = ? AND expires_at > ? ORDER BY created_at DESC",
                             (mask_text(report.root_cause.text), self.clock()))
        for r in rows:
            tenant = str(r["tenant"])
            if report.id != r["report_id"] and (not tenant or job_id.startswith(f"{tenant}:")):
                return Silence(str(r["id"]), str(r["report_id"]), str(r["note"]), float(r["expires_at"]))
        return None
