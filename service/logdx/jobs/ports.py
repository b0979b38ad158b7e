"""What the parts of the job runtime ask of the job manager, as narrow Protocols.

The manager (`manager.py`) owns the coordinators, the hang watch and the views; they call back into it.
Naming its concrete class there closed an import circle (even under `TYPE_CHECKING`); each part names
instead only what it uses, and `JobManager` satisfies every Protocol here (mypy checks it where the
manager hands itself over).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from logdx.act.report import Report
from logdx.config import Settings
from logdx.jobs.background import Actor, Effect, Timer
from logdx.jobs.coordinator import Coordinator
from logdx.jobs.jobstate import Job
from logdx.jobs.metrics import Metrics
from logdx.pipeline import Engine, Session
from logdx.store_base import Store

__all__ = ["CoordinatedJobs", "HangJobs", "ViewedJobs"]


class _Base(Protocol):
    @property
    def settings(self) -> Settings: ...

    @property
    def db(self) -> Store: ...

    @property
    def engine(self) -> Engine | None: ...

    def loaded_jobs(self) -> list[Job]: ...

    def row(self, job_id: str) -> dict[str, Any] | None: ...


class CoordinatedJobs(_Base, Protocol):
    """What a coordinator (one process's spool, or the cluster's bus and partitions) asks of the manager."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def actor(self) -> Actor | None: ...

    @property
    def timer(self) -> Timer: ...

    def held_jobs(self) -> list[Job]: ...

    def get(self, job_id: str) -> Job | None: ...

    def registered(self, job_id: str) -> Job | None: ...

    def unregister(self, job: Job) -> None: ...

    def state_in_db(self, job_id: str) -> str | None: ...

    def feed_runs(self, session: Session, runs: list[tuple[Any, list[bytes]]]) -> int: ...

    def note_end(self, job: Job, meta: dict[str, Any]) -> None: ...

    def lines_arrived(self, job: Job) -> None: ...

    def after_feed(self, job: Job) -> None: ...

    def stored_final(self, job: Job) -> Report | None: ...

    def final_diagnosis(self, job: Job, session: Session, exit_code: int | None) -> Report: ...

    def unacted(self) -> Iterator[Effect]: ...


class HangJobs(_Base, Protocol):
    """What the hang watch asks of the manager: the open jobs, and recording an early report."""

    def record_report(self, job: Job, report: Report, kind: str) -> None: ...


class ViewedJobs(_Base, Protocol):
    """What the read views (describe, templates, the job list) ask of the manager."""

    @property
    def coord(self) -> Coordinator: ...

    def registered(self, job_id: str) -> Job | None: ...

    def get_report(self, report_id: str) -> Report | None: ...
