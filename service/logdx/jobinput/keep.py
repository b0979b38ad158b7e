"""Keeping a diagnosis of a job's inputs: the report stored (for `diagnose feedback`), the nodes its log named
and blamed (for `logdx nodes`) and what the failure cost. Shared by the faces that diagnose files (`diagnose`,
`logdx mcp` with actions allowed)."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from logdx.config import Settings
    from logdx.incidents import IncidentStore
    from logdx.jobinput.read import Diagnosed
    from logdx.pipeline import Engine

__all__ = ["keep"]


def keep(engine: Engine, diagnosed: Diagnosed, job_id: str) -> None:
    """Store the report (for `diagnose feedback`), and the nodes the log named and blamed (for
    `logdx nodes`); a read-only or locked store must not cost the report: it says so in a note."""
    from logdx.act.costs import CostBook
    from logdx.act.nodes import NodeBook
    from logdx.act.policy import cordon_targets
    from logdx.store import MigrationError

    report, settings = diagnosed.report, engine.settings
    try:
        if engine.incidents is None:  # a rules-only engine: no model stage opened the store
            engine.incidents = _open_incidents(settings)
        engine.remember(report, diagnosed.context)
        book = NodeBook(engine.incidents.db, settings.actions)
        book.seen(diagnosed.hosts)
        book.record_diagnosis(job_id, report, cordon_targets(report))
        costs = CostBook(engine.incidents.db)
        costs.record(job_id, report)
        if diagnosed.session is not None:
            costs.follow(job_id, diagnosed.session.summary().progress)
    except (OSError, sqlite3.Error, MigrationError) as e:
        report.notes.append(f"report not stored ({e}); feedback on it will not be possible")


def _open_incidents(settings: Settings) -> IncidentStore:
    from logdx.incidents import IncidentStore
    from logdx.store import open_db

    return IncidentStore(open_db(settings.store.location, settings.store.pool_size))
