"""What differs between one process and several replicas, behind one `JobManager`.

A `Coordinator` decides where a job's lines and state live and who applies them:

- `EmbeddedCoordinator` (`jobs/embedded.py`, one process, the default): every job's lines go to its
  spool file and are applied to its session here; a session is rebuilt by replaying the spool.
- `ClusterCoordinator` (`jobs/cluster.py`, `bus.url` + `store.url`): lines are published to the
  line bus; the replica that owns the job's partition applies them and saves the session in
  PostgreSQL; the others read what it saved.

The `JobManager` (`jobs/manager.py`) holds what both share: the job rows and registry, diagnosis
(early, hangs, final), reports and what they change, reading, retention.
"""

from __future__ import annotations

from typing import Any, Protocol

from logdx.act.report import Report
from logdx.jobs.budget import CpuBudget
from logdx.jobs.jobstate import IngestRequest, Job
from logdx.normalize import Source
from logdx.pipeline import Session
from logdx.store_base import StoreError


class Coordinator(Protocol):
    queues_until_ready: bool
    """Whether uploads are taken (and counted as queued) while the engine loads."""

    # -- sessions --------------------------------------------------------------------------------

    def session(self, job: Job) -> Session:
        """The job's session with every committed line applied (hold `job.tlock`); an `ApiError`
        when this process cannot have it (another replica owns the job)."""
        ...

    def open_session(self, job: Job) -> Session | None:
        """The session reads of an open job come from (hold `job.tlock`), or None when its lines are
        not held here: reads then come from what was saved."""
        ...

    def evict_if_needed(self, keep: Job | None) -> None:
        """Past `server.max_sessions`: drop the least recently used sessions that can go."""
        ...

    # -- ingestion ---------------------------------------------------------------------------------

    def check_ingest(self) -> None:
        """Raise an `ApiError` when this process takes no uploads at all."""
        ...

    def spool_runs(self, job: Job, req: IngestRequest, runs: list[tuple[Source, list[bytes]]], lines: int) -> None:
        ...

    def duplicate_of(self, job: Job, key: str) -> dict[str, Any] | None:
        ...

    def finish_request(self, job: Job, req: IngestRequest, ok: bool, budget: CpuBudget | None = None) -> dict[str, Any]:
        ...

    def end(self, job: Job, exit_code: int | None) -> Report:
        ...

    # -- what the shared parts ask -----------------------------------------------------------------

    def store_outage(self, what: str, error: StoreError) -> bool:
        """Whether a store outage met by `what` is waited out (noted; the caller retries) rather than raised."""
        ...

    def notes(self, job: Job) -> list[str]:
        """Notes every report of the job starts with."""
        ...

    def details(self, job: Job) -> dict[str, Any]:
        """What `GET /v1/jobs/{id}` adds about the job."""
        ...

    def forgotten(self, job_id: str) -> None:
        """Retention deleted the job's rows: delete what this side kept of it."""
        ...

    def close(self) -> None:
        ...
