"""Everything the routes use, built once per app: database, stores, jobs, alerts, actions, engine.

Start-up order: the database and stores open at once (cheap); the engine (rules, and models when
retrieval or the LLM are on) loads in a worker thread so /healthz answers while it loads and
/readyz turns 200 when it is done; then open jobs are recovered (spools replayed) and diagnosis
changes that were stored but not acted on before a crash are acted on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from logdx.act.actuators import Actions
from logdx.act.alerts import Outbox, OutboxWorker
from logdx.act.report import Report
from logdx.api.background import Actor, Effect
from logdx.api.jobs import Job, JobManager
from logdx.api.metrics import Metrics
from logdx.config import Settings
from logdx.incidents import IncidentStore
from logdx.pipeline import Engine
from logdx.store import Database, open_db

log = logging.getLogger("logdx.api")
T = TypeVar("T")


@dataclass
class Services:
    settings: Settings
    db: Database
    incidents: IncidentStore
    jobs: JobManager
    metrics: Metrics
    outbox: Outbox
    outbox_worker: OutboxWorker
    actions: Actions
    actor: Actor
    engine: Engine | None = None
    startup_error: str | None = None
    recovering: int = 0
    limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(32))

    @classmethod
    def open(cls, settings: Settings) -> Services:
        metrics = Metrics()
        db = open_db(settings.store.path)
        incidents = IncidentStore(db)
        jobs = JobManager(settings, db, incidents, metrics)
        outbox = Outbox(db, settings.alerts, settings.server.public_url,
                        on_delivery=lambda kind, outcome: metrics.alert_deliveries.labels(kind, outcome).inc())
        worker = OutboxWorker(outbox)
        actions = Actions(db, settings.actions)

        def enqueue(job_id: str, report: Report) -> bool:
            queued = outbox.enqueue(job_id, report)
            metrics.alerts_enqueued.labels("queued" if queued else "skipped").inc()
            if queued:
                worker.wake()
            return queued

        def done(effect: Effect, _queued: bool, records: list[Any]) -> None:
            for rec in records:
                metrics.actions.labels(getattr(rec, "action", "?"), getattr(rec, "outcome", "?")).inc()
            jobs.acted(effect.job_id, effect.key)

        actor = Actor(enqueue, actions.apply, done)
        services = cls(settings=settings, db=db, incidents=incidents, jobs=jobs, metrics=metrics, outbox=outbox,
                       outbox_worker=worker, actions=actions, actor=actor)
        metrics.add_state(services._gauges)
        return services

    def _gauges(self) -> dict[str, Any]:
        state = self.jobs.state_gauges()
        state["Whether the engine is loaded|logdx_ready"] = 1.0 if self.engine is not None else 0.0
        pending = self.db.query_value("SELECT COUNT(*) FROM alert_outbox WHERE status = 'pending'")
        state["Alerts waiting for delivery|logdx_alerts_pending"] = float(pending or 0)
        return state

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.actor.start()
        self.outbox_worker.start()

    async def load_engine(self, engine: Engine | None = None) -> None:
        """Load the engine off the event loop, then recover open jobs."""
        t0 = time.perf_counter()
        try:
            if engine is None:
                engine = await anyio.to_thread.run_sync(
                    lambda: Engine.create(self.settings, incidents=self.incidents, warm=True)
                )
        except Exception as e:  # noqa: BLE001 - reported by /readyz, logged here
            log.exception("the engine failed to load")
            self.startup_error = f"{type(e).__name__}: {e}"
            return
        self.jobs.attach(engine, self.actor)
        self.engine = engine
        log.info("engine ready in %.1fs (%d rules)", time.perf_counter() - t0, len(engine.rules.rules))
        await self.recover()

    async def recover(self) -> None:
        for effect in self.jobs.unacted():
            log.info("job %s: acting on a diagnosis stored before the last stop", effect.job_id)
            self.actor.submit(effect)
        ids = self.jobs.open_job_ids()
        self.recovering = len(ids)
        for job_id in ids:
            job = self.jobs.get(job_id)
            if job is not None:
                try:
                    await self.run_locked(job, self.jobs.warm, job)
                except Exception:  # noqa: BLE001 - one bad spool must not stop the others
                    log.exception("job %s: recovery failed", job_id)
            self.recovering -= 1
        if ids:
            log.info("recovered %d open job(s)", len(ids))

    def stop(self) -> None:
        self.actor.stop()
        self.outbox_worker.stop()
        self.outbox.close()
        self.jobs.close()
        self.db.close()

    # -- running work off the event loop ------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def run_locked(self, job: Job, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` in a worker thread once the job's other uploads are done with it: waiters
        queue on the event loop, so a busy job never ties up the thread pool."""
        async with job.alock:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)
