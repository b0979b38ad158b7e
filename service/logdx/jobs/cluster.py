"""Jobs when several replicas run (`bus.url` + `store.url`): the `Coordinator` with
the line bus instead of the spool files and partitions owned by one worker at a time.

Ingestion (`jobs/bus_ingest.py`): uploads are published to the job's partition of the line bus.

Diagnosis (role `worker` or `all`): the coordinator thread heartbeats, renews its partitions' leases
and claims free ones up to its fair share (`logdx.bus.ownership`). Each owned partition has a thread
that reads its records in stream order and applies them to the jobs' sessions as the spool reader
does (DATA waits for its END; an END commits its request's lines, once per key; FIN ends the job),
then the usual machinery runs: early diagnosis 2 s after a root cause, hang checks, reports stored
and acted on through the job row's compare-and-set, alerts through the shared outbox. Every
`bus.snapshot_interval_s` the owner saves its changed sessions (`Session.snapshot()`) with the last
sequence each holds, marks the partition saved through its last record, and acks the bus. A new
owner restores those sessions (and re-arms the early diagnosis of a job that saw a root cause) and
re-reads the partition from after the snapshot; a record a session already holds is skipped by its
sequence: no accepted line is lost and none is applied twice.

Reads (any replica): a job's row, its figures and templates as its owner last saved them.

Faults (the README's "Running more than one replica" says what a client sees):

- No silent gap. The stream refuses records when full rather than dropping old ones
  (`logdx.bus.jetstream`), and nothing is purged before every partition saved it. An owner still
  checks: an END whose DATA records are missing, a stream that lost records after the partition's
  snapshot (or was replaced), a job whose acknowledged lines (counted per job by the ingest
  replicas, `bus_job_acks`) exceed the lines its owner applied when it ends. Each is logged as an
  error, counted (`logdx_bus_gaps_total`, `logdx_bus_lost_lines_total`), stored with the job
  (`GET /v1/jobs/{id}`: `bus_gaps`) and noted first in its reports; an upload whose lines are missing
  is never recorded as committed.
- Reclaim. After each snapshot the owner marks what its partition still needs (`keep_from`) and
  the stream is purged below the least of all partitions': it holds what was not saved yet, not
  history. Uploads are refused with 503 `bus_full` before the stream is full, so that END and FIN
  records still fit: a full bus lets `/end` through. Owners save sooner while the bus is half full.
- Outages. A store or bus error is a 503 with Retry-After (`store_unavailable`, `bus_unavailable`).
  A record that cannot be applied because PostgreSQL is down is applied again when it is back,
  never skipped; snapshots wait. The owner keeps its partitions through a NATS or PostgreSQL
  outage; after one, a replica takes over no other owner's partition for `bus.store_grace_s`
  (owners renew first) and treats no ingest replica as dead. A request whose end could not be
  published is ended (aborted) later, so its records do not pin the stream.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from logdx.act.report import Report
from logdx.bus.base import BusError, BusUsage, LineBus
from logdx.bus.ownership import WORKER_ROLES, Claim, Ownership, SavedJob
from logdx.bus.records import partition_of
from logdx.jobs.budget import CpuBudget
from logdx.jobs.bus_ingest import BusIngest
from logdx.jobs.jobstate import IngestRequest, Job, summary_dict, templates_snapshot
from logdx.jobs.partitions import PartitionWorker, gap_note
from logdx.jobs.ports import CoordinatedJobs
from logdx.normalize import Source
from logdx.pipeline import Session
from logdx.store_base import StoreError
from logdx.wire.errors import ApiError

log = logging.getLogger("logdx.cluster")

_COMMITTED_SAVED = 1000  # Idempotency-Keys kept in a saved session (upload_keys has them all)
_PENDING_MAX_AGE_S = 3600.0  # a request that never ended (its replica lost it) is dropped after this
_ABANDONED_AFTER_S = 60.0  # a replica silent this long (and 5 leases) died: its unfinished uploads are void
_WARN_EVERY_S = 30.0


class ClusterCoordinator:
    """Partitions of the line bus owned by one replica at a time (`Coordinator`)."""

    queues_until_ready = False

    def __init__(self, jobs: CoordinatedJobs, bus: LineBus, ownership: Ownership) -> None:
        self.jobs = jobs
        self.settings = settings = jobs.settings
        self.db = jobs.db
        self.metrics = jobs.metrics
        self.bus = bus
        self.own = ownership
        self.replica = ownership.replica
        self.role = settings.server.role
        self.partitions = settings.bus.partitions
        self._workers: dict[int, PartitionWorker] = {}
        self._workers_lock = threading.Lock()
        self._stop = threading.Event()
        self._coordinator: threading.Thread | None = None
        self.takeovers = 0
        self.applied_lines = 0  # fed to sessions of owned partitions (the work balance)
        self._store_down_since: float | None = None  # monotonic; set while this replica cannot reach the store
        self._store_back_at = -float("inf")  # monotonic: when it last came back
        self._purged_before = 0
        self._warned: dict[str, float] = {}
        self.ingest = BusIngest(jobs, bus, ownership, self.warn)
        self.own.heartbeat()

    # -- life cycle -----------------------------------------------------------------------------

    def start_cluster(self) -> None:
        """Start heartbeats and, on workers, partition ownership (call once the engine is attached)."""
        self._coordinator = threading.Thread(target=self._coordinate, name="logdx-cluster", daemon=True)
        self._coordinator.start()

    def close(self) -> None:
        self._stop.set()
        if self._coordinator is not None:
            self._coordinator.join(10)
        for worker in self.owned_workers():
            worker.stop(graceful=True)
        for worker in self.owned_workers():
            worker.join()
        try:
            self.own.stopped()
        except Exception:
            log.exception("could not record this replica's stop")

    def owned_workers(self) -> list[PartitionWorker]:
        with self._workers_lock:
            return list(self._workers.values())

    def owned(self) -> list[int]:
        with self._workers_lock:
            return sorted(self._workers)

    # -- the coordinator: heartbeats, leases, balance -----------------------------------------

    def _coordinate(self) -> None:
        interval = self.settings.bus.lease_s / 3
        while True:
            try:
                self._tick()
            except (StoreError, BusError) as e:
                self.warn("tick", "cluster coordination: %s (retrying every %.1f s)", e, interval)
            except Exception:
                log.exception("cluster coordination failed (retrying)")
            if self._stop.wait(interval):
                return

    def warn(self, key: str, msg: str, *args: Any) -> None:
        """A warning at most every 30 s per kind (outages are retried several times a second)."""
        now = time.monotonic()
        if now - self._warned.get(key, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned[key] = now
            log.warning(msg, *args)

    def store_failed(self) -> None:
        if self._store_down_since is None:
            self._store_down_since = time.monotonic()
            log.warning("store unreachable: partitions are kept, snapshots wait, records wait to be applied")

    def _store_reached(self) -> None:
        if self._store_down_since is not None:
            log.warning("store reachable again after %.1f s; no partition of another owner is taken for %g s",
                        time.monotonic() - self._store_down_since, self.settings.bus.store_grace_s)
            self._store_down_since = None
            self._store_back_at = time.monotonic()

    @property
    def store_settled(self) -> bool:
        """Whether the store has been reachable, without a break, for `bus.store_grace_s`: only then
        is a silent replica taken for dead (after an outage every owner needs time to renew)."""
        return (self._store_down_since is None
                and time.monotonic() - self._store_back_at >= self.settings.bus.store_grace_s)

    def _tick(self) -> None:
        try:
            self.own.heartbeat()
        except StoreError:
            self.store_failed()
            raise
        self._store_reached()
        self.ingest.publish_aborts()
        with self._workers_lock:
            owned = {p: w.epoch for p, w in self._workers.items() if not w.stopping}
        for p in self.own.renew(owned):
            log.warning("partition %d: lease lost (another worker owns it now)", p)
            lost = self._workers.get(p)
            if lost is not None:
                lost.stop(graceful=False)
        if self.role not in WORKER_ROLES or self.jobs.engine is None:
            return
        low, high = self.own.fair_share()
        if len(owned) < high:
            for p in self.own.claimable(held=self.store_settled):
                if len(self.owned()) >= high:
                    break
                if p in owned:
                    continue
                claim = self.own.claim(p)
                if claim is not None:
                    self._take(claim)
        extra = len(owned) - high if len(owned) > high else int(len(owned) > low and self.own.starved(low))
        for p in sorted(owned, reverse=True)[:extra]:
            log.info("partition %d: handed back for balance (%d owned, fair share %d..%d)", p, len(owned), low, high)
            worker = self._workers.get(p)
            if worker is not None:
                worker.stop(graceful=True)

    def _take(self, claim: Claim) -> None:
        t0 = time.perf_counter()
        try:
            usage = self.bus.usage(max_age_s=0)
            claim = self._check_stream_at_takeover(claim, usage)
            reader = self.bus.open_partition(claim.partition, claim.snapshot_seq)
        except (BusError, StoreError) as e:
            self.warn("take", "partition %d: not taken now (%s); handed back", claim.partition, e)
            try:
                self.own.release(claim.partition, claim.epoch)
            except StoreError:
                pass  # its lease runs out
            return
        worker = PartitionWorker(self, claim, reader)
        worker.stream_created = usage.created if usage is not None else ""
        with self._workers_lock:
            self._workers[claim.partition] = worker
        self.takeovers += 1
        restored = self._restore_partition(worker)
        if usage is not None and usage.first_seq > claim.snapshot_seq + 1:
            self._stream_lost_records(worker, claim.snapshot_seq, usage.first_seq)
        worker.start()
        actor = self.jobs.actor
        for effect in self.jobs.unacted():
            if partition_of(effect.job_id, self.partitions) == claim.partition and actor is not None:
                log.info("job %s: acting on a diagnosis its previous owner stored", effect.job_id)
                actor.submit(effect)
        log.info("partition %d: owned (epoch %d) from record %d on, %d job session(s) restored in %.2fs",
                 claim.partition, claim.epoch, claim.snapshot_seq, restored, time.perf_counter() - t0)

    def _check_stream_at_takeover(self, claim: Claim, usage: BusUsage | None) -> Claim:
        """The saved position refers to this stream: else (the stream was replaced, or lost its
        newest records) the partition starts again from the stream's first record, and its open jobs
        are told that records may be missing."""
        if usage is None:
            raise BusError("the stream cannot be read")
        replaced = bool(claim.stream_created and usage.created and claim.stream_created != usage.created)
        if not replaced and usage.last_seq >= claim.snapshot_seq:
            return claim
        why = ("the stream was replaced" if replaced else
               f"the stream ends at record {usage.last_seq}, before this partition's saved position {claim.snapshot_seq}")
        jobs = self.own.reset_partition(claim.partition, claim.epoch)
        log.error("partition %d: %s: reading it again from its first record; what its %d open job(s) had "
                  "sent since their last snapshot may be lost", claim.partition, why, len(jobs))
        for job_id in jobs:
            self.gap(job_id, claim.partition, "stream_reset", None,
                      f"{why}: lines acknowledged before it and not yet saved may be missing")
        return Claim(claim.partition, claim.epoch, 0, "")

    def _stream_lost_records(self, worker: PartitionWorker, after: int, first: int) -> None:
        """Records after the partition's saved position were dropped from the stream (by its age limit,
        an operator's purge or limit): the partition's open jobs may miss lines."""
        if first <= worker.gap_reported_to:
            return
        worker.gap_reported_to = first
        rows = self.db.query("SELECT s.job_id FROM job_sessions s JOIN api_jobs j ON j.job_id = s.job_id"
                             " WHERE s.partition = ? AND j.state = 'open'", (worker.partition,))
        ids = {r["job_id"] for r in rows} | set(worker.jobs)
        log.error("partition %d: records %d..%d were removed from the stream before this partition's owner "
                  "saved them (an age limit, or an operator's purge or limit): %d open job(s) may miss lines",
                  worker.partition, after + 1, first - 1, len(ids))
        self.metrics.bus_gaps.labels("stream_lost_records").inc()
        for job_id in sorted(ids):
            self.gap(job_id, worker.partition, "stream_lost_records", None,
                      f"records {after + 1}..{first - 1} of the line bus were removed before they were saved")

    def gap(self, job_id: str, partition: int, kind: str, lines: int | None, detail: str) -> None:
        """Tell what an owner found missing: the error log, the metrics, the job's state and reports."""
        if lines is not None:
            log.error("job %s: %d acknowledged line(s) missing from the diagnosis: %s", job_id, lines, detail)
            self.metrics.bus_lost_lines.inc(lines)
        self.metrics.bus_gaps.labels(kind).inc()
        self.own.record_gap(job_id, partition, kind, lines, detail)

    def _restore_partition(self, worker: PartitionWorker) -> int:
        """Load the partition's open jobs that have a saved session, so an early diagnosis that was
        due (or a hang) is not forgotten while no new line arrives."""
        rows = self.db.query("SELECT s.job_id FROM job_sessions s JOIN api_jobs j ON j.job_id = s.job_id"
                             " WHERE s.partition = ? AND j.state = 'open' ORDER BY j.updated_at DESC LIMIT ?",
                             (worker.partition, self.settings.server.max_sessions))
        n = 0
        for r in rows:
            job = self.jobs.get(r["job_id"])
            if job is not None and job.state == "open":
                with job.tlock:
                    worker.owned_session(job)
                n += 1
        return n

    def worker_stopped(self, worker: PartitionWorker) -> None:
        """A partition's thread ended (lost, handed back, or shutting down): drop its sessions."""
        with self._workers_lock:
            if self._workers.get(worker.partition) is worker:
                del self._workers[worker.partition]
        for job_id in list(worker.jobs):
            job = self.jobs.registered(job_id)
            if job is None:
                continue
            with job.tlock:
                job.drop_session()
                job.bus_seq = 0
                job.bus_pending = {}
                job.bus_data = {}

    def evict_if_needed(self, keep: Job | None) -> None:
        """Over `server.max_sessions`: save the least recently used sessions, then drop them."""
        limit = self.settings.server.max_sessions
        loaded = self.jobs.loaded_jobs()
        for job in sorted(loaded, key=lambda j: j.last_used)[: max(0, len(loaded) - limit)]:
            if job is keep or job.scheduled or not job.tlock.acquire(blocking=False):
                continue
            try:
                worker = self._worker_of(job.id)
                if self.store_settled:
                    self._drop_abandoned(job)
                if worker is not None and self.own.save_snapshot(worker.partition, worker.epoch, None,
                                                                 [self._saved(job)]):
                    job.drop_session()
                    worker.jobs.discard(job.id)
                    log.info("job %s: session saved and evicted from memory (max_sessions=%d)", job.id, limit)
            finally:
                job.tlock.release()

    def _worker_of(self, job_id: str) -> PartitionWorker | None:
        with self._workers_lock:
            return self._workers.get(partition_of(job_id, self.partitions))

    # -- snapshots ---------------------------------------------------------------------------------

    def snapshot(self, worker: PartitionWorker) -> bool:
        """Save the partition's changed sessions and mark it saved through its last applied record
        (through the stream's last when the partition has nothing left to read); ack the bus; purge
        what every partition has saved. False when the partition is no longer ours."""
        if worker.idle:
            position = worker.reader.caught_up_to()
            if position is not None and position > worker.applied:
                worker.applied = position
        usage = self.bus.usage(max_age_s=0)  # read after `applied`: its last record cannot be older
        if usage is not None:
            if usage.last_seq < worker.applied or (worker.stream_created and usage.created
                                                   and usage.created != worker.stream_created):
                log.error("partition %d: the stream was replaced or lost its newest records: handing the "
                          "partition back to be read again from the start", worker.partition)
                return False
            if usage.first_seq > worker.applied + 1:
                self._stream_lost_records(worker, worker.applied, usage.first_seq)
        saved: list[SavedJob] = []
        figures: list[tuple[Any, ...]] = []
        for job_id in list(worker.jobs):
            job = self.jobs.registered(job_id)
            if job is None or job.session is None:
                worker.jobs.discard(job_id)
                continue
            with job.tlock:
                if not job.dirty or job.session is None:
                    continue
                if self.store_settled:
                    self._drop_abandoned(job)
                saved.append(self._saved(job))
                figures.append(self._figures(job, job.session))
                job.dirty = False
        if not saved and worker.applied == worker.saved:
            return True
        try:
            if not self.own.save_snapshot(worker.partition, worker.epoch, worker.applied, saved,
                                          stream_created=worker.stream_created):
                return False
        except StoreError:
            for job_id in {j.job_id for j in saved}:
                job = self.jobs.registered(job_id)
                if job is not None:
                    job.dirty = True  # saved next time
            raise
        if figures:
            self.db.executemany("UPDATE api_jobs SET lines = ?, summary = ?, templates = ? WHERE job_id = ?"
                                " AND state = 'open'", figures)
        worker.reader.ack(worker.applied)
        worker.saved = worker.applied
        self._purge(usage)
        return True

    def _purge(self, usage: BusUsage | None) -> None:
        """Drop from the stream what every partition has saved (once per new floor)."""
        floor = self.own.purge_floor()
        if floor <= max(self._purged_before, usage.first_seq if usage is not None else 0):
            return
        try:
            self.bus.purge_before(floor)
            self._purged_before = floor
        except BusError as e:
            self.warn("purge", "the stream was not purged before record %d (%s): next snapshot", floor, e)

    def _saved(self, job: Job) -> SavedJob:
        assert job.session is not None
        committed = list(job.committed.items())[-_COMMITTED_SAVED:]
        seqs = [s for p in job.bus_pending.values() for s in p.get("seqs", [])]
        state: dict[str, Any] = {"pending": job.bus_pending, "committed": committed}
        if job.bus_fed is not None:
            state["fed"] = job.bus_fed
        return SavedJob(job.id, job.bus_seq, job.session.snapshot(), state, min(seqs) if seqs else None)

    @staticmethod
    def _figures(job: Job, session: Session) -> tuple[Any, ...]:
        return (session.lines, json.dumps(summary_dict(session)), json.dumps(templates_snapshot(session)), job.id)

    def _drop_abandoned(self, job: Job) -> None:
        """Requests whose replica died before their END (the client got no 2xx: it sends again), or
        that never ended, are dropped."""
        if not job.bus_pending:
            return
        # Silent for long, not just past a lease: a busy replica that is late to beat still sends its END.
        silent_s = max(_ABANDONED_AFTER_S, 5 * self.settings.bus.lease_s)
        dead = self.own.dead_replicas((p["i"] for p in job.bus_pending.values()), silent_s)
        now = time.time()
        for r, p in list(job.bus_pending.items()):
            if p["i"] in dead or now - float(p.get("at", now)) > _PENDING_MAX_AGE_S:
                del job.bus_pending[r]
                for s in p["seqs"]:
                    job.bus_data.pop(s, None)

    # -- what the shared parts ask ---------------------------------------------------------------

    def session(self, job: Job) -> Session:
        if job.session is None:
            raise ApiError(503, "not_owner", f"job {job.id} is diagnosed by another replica")
        return job.session

    def open_session(self, job: Job) -> Session | None:
        return job.session

    def check_ingest(self) -> None:
        if self.role == "worker":
            raise ApiError(503, "not_ingest", "this replica only diagnoses (server.role: worker); "
                           "send logs to an ingest replica")

    def store_outage(self, what: str, error: StoreError) -> bool:
        self.store_failed()
        self.warn(what, "%s (%s)", what, error)
        return True

    def notes(self, job: Job) -> list[str]:
        """Reports of a job that the bus failed say so first (the gaps its owners found)."""
        note = gap_note(self.own.gaps(job.id))
        return [note] if note else []

    def details(self, job: Job) -> dict[str, Any]:
        return {"bus_gaps": self.own.gaps(job.id)}

    def forgotten(self, job_id: str) -> None:
        self.own.forget_job_entirely(job_id)

    # -- ingestion (any ingest replica): jobs/bus_ingest.py -----------------------------------------

    def spool_runs(self, job: Job, req: IngestRequest, runs: list[tuple[Source, list[bytes]]], lines: int) -> None:
        self.ingest.spool_runs(job, req, runs, lines)

    def duplicate_of(self, job: Job, key: str) -> dict[str, Any] | None:
        return self.ingest.duplicate_of(job, key)

    def finish_request(self, job: Job, req: IngestRequest, ok: bool, budget: CpuBudget | None = None) -> dict[str, Any]:
        return self.ingest.finish_request(job, req, ok, budget)

    def end(self, job: Job, exit_code: int | None) -> Report:
        return self.ingest.end(job, exit_code)

    # -- the cluster's state (GET /v1/cluster) ----------------------------------------------------

    def cluster(self) -> dict[str, Any]:
        """Replicas, partitions (owner, lease, saved and applied records, lag), this replica."""
        parts = self.own.partitions_table()
        for p in parts:
            p["lag"] = self.bus.lag(p["partition"]) if p["owner"] else None
            p["applied_seq"] = max(p["applied_seq"], self._applied_here(p["partition"]))
        return {"replica": self.replica, "role": self.role, "partitions": parts, "replicas": self.own.replicas_table(),
                "bus": {"prefix": self.settings.bus.prefix, "partitions": self.partitions}}

    def _applied_here(self, partition: int) -> int:
        with self._workers_lock:
            worker = self._workers.get(partition)
        return worker.applied if worker is not None else 0
