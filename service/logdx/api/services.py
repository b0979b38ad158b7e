"""Everything the routes use, built once per app: database, stores, jobs, alerts, actions, engine.

Start-up order: the database and stores open at once (cheap); the engine (rules, and models when
retrieval or the LLM are on) loads in a worker thread so /healthz answers while it loads and
/readyz turns 200 when it is done; then open jobs are recovered (spools replayed) and diagnosis
changes that were stored but not acted on before a crash are acted on.

While it loads, the log says each step and how far it got, and /readyz says what it waits for: one
check per part (`readiness`: "rules", "retrieval", "llm"; dependency checks are added the same way).
Reads answer from the database, and uploads are spooled: their lines are queued for the engine.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from logdx import progress
from logdx.access.auth import Authenticator, Principal, Tenants, job_not_found, report_not_found
from logdx.act.actuators import KubernetesActuator
from logdx.act.respond import Responder, Response
from logdx.api.cookies import SessionCookies
from logdx.api.guard import REFUSAL_REASONS
from logdx.bus.ownership import WORKER_ROLES
from logdx.config import Settings
from logdx.incidents import IncidentStore
from logdx.jobs.background import Actor, Effect
from logdx.jobs.cluster import ClusterCoordinator
from logdx.jobs.manager import Job, JobManager
from logdx.jobs.metrics import Metrics
from logdx.jobs.nodestreams import NodeJoiner, NodeStreams
from logdx.jobs.quotas import JobQuota
from logdx.jobs.readiness import Component, Readiness
from logdx.jobs.retention import KINDS, Sweeper
from logdx.pipeline import Engine
from logdx.store import Store, open_db

log = logging.getLogger("logdx.api")
T = TypeVar("T")


@dataclass
class Services:
    settings: Settings
    db: Store
    incidents: IncidentStore
    jobs: JobManager
    metrics: Metrics
    responder: Responder  # alerts and actions
    actor: Actor
    sweeper: Sweeper
    quota: JobQuota
    auth: Authenticator
    tenants: Tenants
    readiness: Readiness = field(default_factory=Readiness)
    engine: Engine | None = None
    startup_error: str | None = None
    recovering: int = 0
    cookies: SessionCookies | None = None  # the job pages' sessions (api/cookies.py)
    limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(32))
    nodes: NodeJoiner | None = None  # node streams joined to jobs

    @classmethod
    def open(cls, settings: Settings) -> Services:
        metrics = Metrics(replica=replica_id(settings) if settings.bus.url else "")
        db = open_db(settings.store.location, settings.store.pool_size, settings.store.timeout_s)
        incidents = IncidentStore(db)
        jobs = _job_manager(settings, db, incidents, metrics)
        responder = Responder(db, settings, public_url=settings.server.public_url,
                              on_delivery=lambda kind, outcome: metrics.alert_deliveries.labels(kind, outcome).inc())

        def done(effect: Effect, response: Response) -> None:
            metrics.alerts_enqueued.labels("queued" if response.alert_queued else "skipped").inc()
            for rec in response.actions:
                metrics.actions.labels(rec.action, rec.outcome).inc()
            jobs.acted(effect.job_id, effect.key)

        actor = Actor(responder, done)
        sweeper = Sweeper(settings, db, jobs, on_deleted=lambda kind, n: metrics.retention_deleted.labels(kind).inc(n))
        for kind in KINDS:  # every series from the start, at 0: bounded, and plain to graph
            metrics.retention_deleted.labels(kind)
        for reason in REFUSAL_REASONS:
            metrics.refused.labels(reason)
        services = cls(settings=settings, db=db, incidents=incidents, jobs=jobs, metrics=metrics,
                       responder=responder, actor=actor, sweeper=sweeper,
                       quota=JobQuota(settings.server, lambda: _open_jobs(db)),
                       auth=Authenticator(settings.server, settings.actions.section_of(KubernetesActuator.name)), tenants=Tenants(db))
        services.cookies = SessionCookies(db, services.auth)
        role = settings.server.role
        services.nodes = NodeJoiner(settings.nodes, NodeStreams(settings.nodes, db), jobs,
                                    acts=role in WORKER_ROLES, ingests=role != "worker")
        services.readiness.component("rules")
        if settings.retrieval.enabled:
            services.readiness.component("retrieval")
        if settings.llm.enabled:
            services.readiness.component("llm")
        from logdx.jobs.readiness import dependency_probes

        for name, probe in dependency_probes(services).items():
            services.readiness.add(name, probe)
        metrics.add_state(services._gauges)
        return services

    # -- tenants apart: what a caller may name -----------------------------------------------

    def job_for(self, principal: Principal, job_id: str) -> Job:
        """The job the caller names; 404 when it does not exist or is another tenant's (one answer for
        both: a tenant's token never learns which of another tenant's ids exist)."""
        job = self.jobs.get(self.tenants.job_id(principal, job_id))
        if job is None:
            raise job_not_found(job_id)
        return job

    def tenant_jobs(self, principal: Principal) -> tuple[str, list[Any]] | None:
        """The condition on a job row `j` that keeps a tenant's token to its tenant's jobs (None: every job)."""
        return self.tenants.jobs_of(principal.tenant) if principal.tenant else None

    def report_tenant_for(self, principal: Principal, report_id: str) -> str:
        """The tenant of the report the caller names; 404 when it does not exist or is another tenant's."""
        tenant = self.tenants.of_report(report_id)
        if tenant is None or (principal.tenant and tenant != principal.tenant):
            raise report_not_found(report_id)
        return tenant

    def part(self, name: str) -> Component | None:
        """The readiness check of an engine part that reports itself (rules, retrieval, llm)."""
        check = self.readiness.get(name)
        return check if isinstance(check, Component) else None

    @property
    def cluster(self) -> ClusterCoordinator | None:
        """The coordinator of a cluster (bus.url set), or None for the embedded single process."""
        coord = self.jobs.coord
        return coord if isinstance(coord, ClusterCoordinator) else None

    @property
    def acts(self) -> bool:
        """Whether this replica acts and alerts (workers do; ingest replicas only publish)."""
        return self.settings.server.role in WORKER_ROLES

    def _gauges(self) -> dict[str, Any]:
        state = self.jobs.state_gauges()
        state["Whether the engine is loaded|logdx_ready"] = 1.0 if self.engine is not None else 0.0
        state["Uploads in progress|logdx_uploads_in_progress"] = float(self.jobs.active_uploads())
        state["Alerts waiting for delivery|logdx_alerts_pending"] = float(self.responder.outbox.pending_count())
        cluster = self.cluster
        if cluster is not None:
            owned = cluster.owned()
            state["Partitions of the line bus this replica owns (1 each)|partition:logdx_partition_owned"] = {
                str(p): 1.0 for p in owned}
            state["Records of an owned partition not read yet|partition:logdx_partition_lag"] = {
                str(p): float(cluster.bus.lag(p) or 0) for p in owned}
            state["Partitions this replica took over or claimed since it started|logdx_partition_takeovers"] = float(
                cluster.takeovers)
            state["Lines applied to the sessions of this replica's partitions since it started|"
                  "logdx_bus_applied_lines"] = float(cluster.applied_lines)
            state["Whether this replica is connected to NATS|logdx_bus_connected"] = float(cluster.bus.connected)
            usage = cluster.bus.usage(max_age_s=1.0)
            if usage is not None:
                state["Bytes the line bus's stream holds (records not yet saved by their owner)|"
                      "logdx_bus_stored_bytes"] = float(usage.bytes)
                state["Records the line bus's stream holds|logdx_bus_stored_records"] = float(usage.records)
                state["The stream's size limit in bytes (0: none of its own)|logdx_bus_max_bytes"] = float(
                    usage.max_bytes)
        return state

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.acts:
            self.actor.start()
            self.responder.start()
            if self.cluster is not None and self.nodes is not None:
                self.nodes.start()  # late node lines that ingest replicas stored re-open diagnoses here
        self.sweeper.start()

    async def load_engine(self, engine: Engine | None = None) -> None:
        """Load the engine off the event loop, saying what it loads; then recover open jobs."""
        t0 = time.perf_counter()
        listener = progress.add_listener(self._on_progress)
        try:
            engine = await anyio.to_thread.run_sync(self._build_engine, engine)
        except Exception as e:
            log.exception("the engine failed to load")
            self.startup_error = f"{type(e).__name__}: {e}"
            return
        finally:
            progress.remove_listener(listener)
        self.jobs.attach(engine, self.actor)
        self.engine = engine
        log.info("engine ready in %.1fs (%d rules)", time.perf_counter() - t0, len(engine.rules.rules))
        await self.recover()

    def _build_engine(self, engine: Engine | None) -> Engine:
        """The rules, then each model stage, each part's readiness check saying where it is."""
        rules = self.part("rules")
        if engine is None:
            dirs = ", ".join(str(d) for d in self.settings.rules.dirs) or "the packaged ones"
            self._loading(rules, f"loading the rule packs ({dirs}) and the error catalog")
            try:
                engine = Engine.create(self.settings, incidents=self.incidents)
            except Exception as e:
                self._failed(rules, e)
                raise
        self._done(rules, f"{len(engine.rules.rules)} rules")
        for name, what, load in engine.model_stages():
            part = self.part(name)
            self._loading(part, what)
            try:
                loaded = load()
            except Exception as e:
                self._failed(part, e)
                raise
            self._done(part, loaded)
        for name in ("retrieval", "llm"):  # enabled, but nothing to load (a remote LLM)
            part = self.part(name)
            if part is not None and not part.ready:
                self._done(part, "nothing to load")
        return engine

    @staticmethod
    def _loading(part: Component | None, what: str) -> None:
        log.info("%s: %s", part.name if part else "engine", what)
        if part is not None:
            part.loading(what)

    @staticmethod
    def _done(part: Component | None, what: str) -> None:
        if part is not None:
            log.info("%s: ready (%s)", part.name, what)
            part.done(what)

    @staticmethod
    def _failed(part: Component | None, e: Exception) -> None:
        if part is not None:
            part.failed(f"{type(e).__name__}: {e}")

    def _on_progress(self, event: str, stage: progress.Stage) -> None:
        """A slow first-time step inside a part (converting the LLM, indexing incidents): its
        readiness check says which, and how far it got."""
        part = self.part(stage.part) if stage.part else None
        if part is not None and event in ("start", "advance"):
            part.loading(stage.what, stage.fraction)

    async def recover(self) -> None:
        if self.cluster is not None:
            self.cluster.start_cluster()  # owners recover their partitions as they take them
            return
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
                except Exception:
                    log.exception("job %s: recovery failed", job_id)
            self.recovering -= 1
        if ids:
            log.info("recovered %d open job(s)", len(ids))

    def stop(self) -> None:
        self.sweeper.stop()
        if self.nodes is not None:
            self.nodes.stop()
        self.jobs.close()  # a cluster's owner saves and hands back its partitions first
        self.actor.stop()
        self.responder.close()
        if self.cluster is not None:
            self.cluster.bus.close()
        self.db.close()

    # -- running work off the event loop ------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def run_locked(self, job: Job, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` in a worker thread once the job's other uploads are done with it: waiters
        queue on the event loop, so a busy job never ties up the thread pool."""
        async with job.alock:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)


def _open_jobs(db: Store) -> int:
    return int(db.query_value("SELECT COUNT(*) FROM api_jobs WHERE state = 'open'") or 0)


def replica_id(settings: Settings) -> str:
    return settings.server.replica_id or f"{socket.gethostname()}-{os.getpid()}"


def _job_manager(settings: Settings, db: Store, incidents: IncidentStore, metrics: Metrics) -> JobManager:
    """The jobs of one process (spool files), or of a cluster (the line bus, partition owners)."""
    if not settings.bus.url:
        return JobManager(settings, db, incidents, metrics)
    from logdx.bus import open_bus
    from logdx.bus.ownership import Ownership

    replica = replica_id(settings)
    s = settings.server
    url = s.public_url or f"http://{s.host}:{s.port}"
    ownership = Ownership(db, replica, s.role, settings.bus.partitions, settings.bus.lease_s, url=url)
    bus = open_bus(settings.bus, name=f"logdx-{replica}")
    return JobManager(settings, db, incidents, metrics, lambda jobs: ClusterCoordinator(jobs, bus, ownership))
